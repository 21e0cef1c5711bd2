"""Train the published DSpark drafter on a frozen target's cached features, then calibrate its confidence head.

Data is self-distillation (:mod:`backends.training.distill`) with the target's features cached once
(:mod:`backends.training.features`). Each training sequence contributes blocks at random anchor positions in its
answer, all drafted in one backbone pass (a mask keeps each block to its own tokens and the context before its
anchor). The target's distribution at a block position comes from its cached last hidden state through the LM
head's rows for the draft vocabulary and its cached normaliser; the mass outside the draft vocabulary is what
the drafter can never propose, and counts against it.

Loss, per block position k with weight w_k = exp(-(k-1)/decay), as DeepSpec's:
0.1 * CE(draft, target's token) + 0.9 * ||p_draft - p_target||_1 + 1.0 * BCE(c_k, 1 - ||p_draft - p_target||_1 / 2),
the last term's label being the probability that speculative sampling accepts token k. Afterwards Sequential
Temperature Scaling fits one temperature per position on half of the held-out sequences, so the prefix survival
a_k = prod c_i that Algorithm 1 ranks by is calibrated; the other half measures the ECE before and after.

Matrix work runs in bfloat16 (autocast) where the CPU has the instructions, the weights and optimizer in float32;
runs show progress, checkpoint every few hundred steps and resume from the last checkpoint.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from backends.dspark.drafter import DSparkDrafter
from backends.dspark.drafter_config import DEFAULT_LAYERS
from backends.loading import LoadedModel, bfloat16_autocast
from backends.progress import JobProgress
from backends.scheduling import prefix_survival
from backends.training.checkpoints import (
    CHECKPOINT_DIR,
    Lineage,
    adamw,
    has_checkpoint,
    out_of_time,
    read_trained_on,
    resume_trainer_state,
    save_trainer_state,
    write_report,
)
from backends.training.distribution_loss import distribution_losses
from backends.training.features import FeatureCache

REPORT_FILE = "train_report_dspark.json"
CURVE_PLOT = "train_curve_dspark.png"
TEMPERATURE_GRID = [round(0.25 * 1.05**i, 4) for i in range(58)]
ECE_BINS = 10


@dataclass
class DrafterTrainConfig:
    output: Path
    steps: int = 3000
    batch_size: int = 8
    anchors: int = 32
    lr: float = 6e-4
    warmup: int = 100
    checkpoint_every: int = 200
    seed: int = 0
    holdout: float = 0.05
    block_size: int = 7
    layers: int | None = None
    """Backbone layers: a fresh drafter's (``DEFAULT_LAYERS`` when None), or with ``init_from`` as many as the
    starting drafter has when None, and more appended where given (:func:`deepened`)."""
    markov_rank: int = 64
    target_layer_ids: list[int] | None = None
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    loss_decay: float = 7.0
    autocast: bool = True
    max_seconds: float | None = None
    """Stop after this long, keeping what was learnt (a leased GPU's time is fixed in advance)."""
    init_from: Path | None = None
    """A trained drafter folder to continue from (its shape, layers and draft vocabulary) instead of a fresh drafter:
    training goes on over a new corpus where the last run left off, so no run has to repeat what one before learnt."""


@dataclass
class KindAcceptance:
    """Held-out acceptance on one kind of request (a corpus source such as ``synth:math`` or
    ``subtask:json_extraction``): a mean over every kind hides which requests the drafter has not learnt."""

    sequences: int
    acceptance_by_position: list[float]
    expected_tokens: float
    greedy_acceptance_by_position: list[float]
    greedy_expected_tokens: float
    initial_acceptance_by_position: list[float] | None = None
    """With ``init_from``: the starting drafter's, on the same sequences."""
    initial_greedy_acceptance_by_position: list[float] | None = None

    @classmethod
    def of(cls, sequences: int, measured: Acceptance, initial: Acceptance | None) -> KindAcceptance:
        return cls(
            sequences,
            measured.sampled,
            tokens_a_round(measured.sampled),
            measured.greedy,
            tokens_a_round(measured.greedy),
            initial.sampled if initial else None,
            initial.greedy if initial else None,
        )


@dataclass
class DrafterTrainReport:
    steps: int
    seconds: float
    first_loss: float
    final_loss: float
    acceptance_by_position: list[float]
    """Held-out mean of 1 - TV/2 per block position: the draft's acceptance rate there under sampling."""
    expected_tokens: float
    """Held-out expected tokens per round with the whole block verified (bonus included), from those rates."""
    greedy_acceptance_by_position: list[float]
    """The same blocks' acceptance under greedy verification (:class:`Acceptance`)."""
    greedy_expected_tokens: float
    ece_before: float
    ece_after: float
    temperatures: list[float] = field(default_factory=list)
    initial_acceptance_by_position: list[float] | None = None
    """With ``init_from``: the starting drafter's acceptance on the same held-out blocks, before this run."""
    initial_greedy_acceptance_by_position: list[float] | None = None
    curve: list[dict[str, float]] = field(default_factory=list)
    acceptance_by_kind: dict[str, KindAcceptance] = field(default_factory=dict)
    """By the corpus source of each held-out sequence (where the cache knows its keys)."""


@dataclass
class BlockBatch:
    """Everything one training forward yields, per (sequence, block, position)."""

    draft_logits: torch.Tensor
    target_logprobs: torch.Tensor
    """Over the draft vocabulary; exp sums to the target's mass inside it."""
    labels: torch.Tensor
    """The target's token as a draft-vocabulary index, -1 where the draft vocabulary lacks it."""
    valid: torch.Tensor
    confidence_logits: torch.Tensor | None
    greedy: torch.Tensor | None = None
    """The target's argmax over its whole vocabulary as a draft-vocabulary index (-1 outside it); measuring only."""

    def l1(self) -> torch.Tensor:
        """||p_draft - p_target||_1 over the whole vocabulary: the mass outside the draft vocabulary is all
        the target's."""
        return distribution_losses(self.draft_logits, self.target_logprobs, self.labels)[0]


def padded_rows(cache: FeatureCache, rows: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded tokens, features, last hidden states and normalisers of ``rows``, with the answer mask."""
    spans = [cache.span(i) for i in rows]
    width = max(s.stop - s.start for s in spans)
    batch, device = len(rows), cache.tokens.device
    out = {
        "ids": torch.zeros(batch, width, dtype=torch.long, device=device),
        "features": cache.features.new_zeros(batch, width, cache.features.shape[1]),
        "final": cache.final.new_zeros(batch, width, cache.final.shape[1]),
        "lse": torch.zeros(batch, width, device=device),
        "continuation": torch.zeros(batch, width, dtype=torch.bool, device=device),
    }
    for r, (index, span) in enumerate(zip(rows, spans)):
        n = span.stop - span.start
        out["ids"][r, :n] = cache.tokens[span]
        out["features"][r, :n] = cache.features[span]
        out["final"][r, :n] = cache.final[span]
        out["lse"][r, :n] = cache.lse[span]
        out["continuation"][r, int(cache.prompt_lens[index]) : n] = True
    return out


def sample_anchors(continuation: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``count`` anchors per row [B, count] where the anchor and the token after it are answer tokens;
    rows with fewer repeat some (harmless duplicates of a block, weighted as the others)."""
    valid = continuation[:, :-1] & continuation[:, 1:]
    scores = torch.rand(valid.shape, generator=generator).to(valid.device).masked_fill(~valid, -1.0)
    order = scores.argsort(dim=1, descending=True)
    have = valid.sum(dim=1, keepdim=True).clamp_min(1)
    picks = torch.arange(count, device=valid.device).unsqueeze(0) % have
    return order.gather(1, picks)


def block_forward(
    drafter: DSparkDrafter,
    cache: FeatureCache,
    to_draft: torch.Tensor,
    rows: list[int],
    anchors_per_row: int,
    generator: torch.Generator,
    greedy: bool = False,
) -> BlockBatch:
    """One drafter pass over every block of the batch, teacher-forced; ``to_draft`` maps a target id to its
    draft-vocabulary index (-1 outside it). ``greedy`` also finds the target's argmax at each block position, over
    the whole vocabulary (an LM head pass training has no use for)."""
    gamma = drafter.block_size
    data = padded_rows(cache, rows)
    ids, continuation = data["ids"], data["continuation"]
    anchors = sample_anchors(continuation, anchors_per_row, generator)
    batch, width = ids.shape
    positions = torch.arange(width, device=ids.device).expand(batch, -1)
    context = drafter.context_keys_values(data["features"], positions)
    offsets = torch.arange(gamma, device=ids.device)
    block_pos = (anchors.unsqueeze(-1) + offsets).view(batch, -1)
    block_ids = torch.full_like(block_pos, drafter.config.mask_token_id)
    block_ids.view(batch, -1, gamma)[..., 0] = ids.gather(1, anchors)
    block_of = torch.arange(block_pos.shape[1], device=ids.device) // gamma
    sees_context = positions.unsqueeze(1) < anchors.repeat_interleave(gamma, dim=1).unsqueeze(-1)
    sees_block = (block_of.unsqueeze(1) == block_of.unsqueeze(0)).expand(batch, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1).unsqueeze(1)
    hidden = drafter.backbone(block_ids, block_pos, context, mask).view(batch, -1, gamma, drafter.config.hidden_size)
    label_pos = anchors.unsqueeze(-1) + offsets + 1
    safe = label_pos.clamp(max=width - 1)
    tokens = ids.gather(1, safe.view(batch, -1)).view_as(safe)
    valid = (label_pos < width) & continuation.gather(1, safe.view(batch, -1)).view_as(safe)
    valid = valid.int().cumprod(dim=-1).bool()
    prev = torch.cat([ids.gather(1, anchors).unsqueeze(-1), tokens[..., :-1]], dim=-1)
    draft_logits = drafter.base_logits(hidden) + drafter.markov_head(prev)
    source = (safe - 1).view(batch, -1)
    final = data["final"].gather(1, source.unsqueeze(-1).expand(-1, -1, data["final"].shape[-1]))
    with torch.no_grad():
        target = drafter.base_logits(final.to(hidden.dtype)).float() - data["lse"].gather(1, source).unsqueeze(-1)
        top = to_draft[drafter.shared[1](final.float()).argmax(dim=-1)].view_as(tokens) if greedy else None
    confidence = drafter.confidence_logits(hidden, prev) if drafter.confidence_head is not None else None
    return BlockBatch(draft_logits, target.view_as(draft_logits), to_draft[tokens], valid, confidence, top)


def block_losses(blocks: BlockBatch, config: DrafterTrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    gamma = blocks.labels.shape[-1]
    decay = torch.exp(-torch.arange(gamma, device=blocks.labels.device) / config.loss_decay)
    weights = blocks.valid.float() * decay
    total = weights.sum().clamp_min(1e-6)
    l1, ce = distribution_losses(blocks.draft_logits, blocks.target_logprobs, blocks.labels)
    in_vocab = weights * (blocks.labels >= 0)
    ce_loss = (ce * in_vocab).sum() / in_vocab.sum().clamp_min(1e-6)
    tv_loss = (l1 * weights).sum() / total
    loss = config.ce_weight * ce_loss + config.tv_weight * tv_loss
    accept = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    survival = (accept * blocks.valid).cumprod(dim=-1)
    rows = blocks.valid[..., 0]
    values = {"ce": ce_loss.item(), "tv": tv_loss.item(), "tau": 1.0 + survival.sum(-1)[rows].mean().item()}
    if blocks.confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(blocks.confidence_logits.float(), accept, reduction="none")
        conf_loss = (bce * weights).sum() / total
        loss = loss + config.confidence_weight * conf_loss
        values["conf"] = conf_loss.item()
    values["loss"] = loss.item()
    return loss, values


def expected_calibration_error(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """Equal-width-bin ECE with soft targets: sum over bins of (share of samples) * |mean pred - mean target|."""
    bins = (predicted * ECE_BINS).long().clamp(max=ECE_BINS - 1)
    error = 0.0
    for b in range(ECE_BINS):
        chosen = bins == b
        if chosen.any():
            error += chosen.float().mean().item() * abs(predicted[chosen].mean().item() - target[chosen].mean().item())
    return error


def survival_ece(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, temperatures: list[float]) -> float:
    """Mean over positions of the ECE of prefix survival a_k = prod sigmoid(l_i / T_i) against prod c*_i."""
    scaled = torch.sigmoid(logits / torch.tensor(temperatures, device=logits.device))
    predicted, target = scaled.cumprod(dim=-1), labels.cumprod(dim=-1)
    errors = [
        expected_calibration_error(predicted[valid[:, k], k], target[valid[:, k], k])
        for k in range(logits.shape[-1])
        if valid[:, k].any()
    ]
    return sum(errors) / len(errors) if errors else 0.0


def sequential_temperature_scaling(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> list[float]:
    """Per position in order, the grid temperature minimising that position's survival ECE, earlier ones fixed;
    dividing logits by a positive temperature keeps every ranking of a position's confidences."""
    gamma = logits.shape[-1]
    temperatures = [1.0] * gamma
    for k in range(gamma):
        if not valid[:, k].any():
            continue

        def ece_at(t: float, k: int = k) -> float:
            trial = [*temperatures[:k], t, *temperatures[k + 1 :]]
            scale = torch.tensor(trial[: k + 1], device=logits.device)
            predicted = torch.sigmoid(logits[:, : k + 1] / scale).cumprod(dim=-1)[:, k]
            target = labels[:, : k + 1].cumprod(dim=-1)[:, k]
            return expected_calibration_error(predicted[valid[:, k]], target[valid[:, k]])

        temperatures[k] = min([1.0, *TEMPERATURE_GRID], key=ece_at)
    return temperatures


@dataclass
class HeldOutBlocks:
    """Every held-out block's outcome by position [blocks, gamma]: its raw confidence logits, the probability that
    speculative sampling at temperature 1 accepts it (1 - TV/2, the confidence head's label), whether greedy
    verification keeps it (the draft's argmax is the target's), and which positions lie inside the answer. Each
    position is drafted given the sequence's tokens before it, as it is once the positions before it were kept."""

    logits: torch.Tensor
    sampled: torch.Tensor
    greedy: torch.Tensor
    valid: torch.Tensor

    def calibration(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What Sequential Temperature Scaling fits: logits, labels and validity."""
        return self.logits, self.sampled, self.valid

    def of_rows(self, chosen: torch.Tensor) -> HeldOutBlocks:
        """The blocks of the sequences ``chosen`` marks, one flag per sequence measured (each has the same number
        of blocks, in the order they were measured)."""
        per_row = self.valid.shape[0] // chosen.shape[0]
        kept = chosen.repeat_interleave(per_row)
        return HeldOutBlocks(self.logits[kept], self.sampled[kept], self.greedy[kept], self.valid[kept])


@torch.no_grad()
def confidence_records(
    drafter: DSparkDrafter, cache: FeatureCache, to_draft: torch.Tensor, rows: list[int], config: DrafterTrainConfig
) -> HeldOutBlocks:
    """The drafter's blocks at seeded anchors of ``rows``, with the raw confidences (temperatures off)."""
    saved, drafter.config.confidence_temperatures = drafter.config.confidence_temperatures, None
    generator = torch.Generator().manual_seed(config.seed + 1)
    parts: list[tuple[torch.Tensor, ...]] = []
    with _autocast(config, cache.tokens.device), JobProgress() as progress:
        task = progress.add_job("held-out blocks", total=len(rows))
        for start in range(0, len(rows), config.batch_size):
            chunk = rows[start : start + config.batch_size]
            blocks = block_forward(drafter, cache, to_draft, chunk, config.anchors, generator, greedy=True)
            kept = (blocks.draft_logits.argmax(dim=-1) == blocks.greedy) & (blocks.greedy >= 0)
            sampled = (1.0 - 0.5 * blocks.l1()).clamp(0.0, 1.0)
            parts.append((blocks.confidence_logits.float(), sampled, kept, blocks.valid))
            progress.step(task, advance=len(chunk))
    drafter.config.confidence_temperatures = saved
    return HeldOutBlocks(*(torch.cat([part[i] for part in parts]).flatten(0, 1) for i in range(4)))


def calibrate(
    drafter: DSparkDrafter, cache: FeatureCache, to_draft: torch.Tensor, held_out: list[int], config: DrafterTrainConfig
) -> tuple[float, float, list[float], list[float]]:
    """Fit temperatures on one half of ``held_out``, measure ECE before/after on the other; set them on the
    drafter. Also returns the per-position acceptance on the measuring half."""
    fitting, measuring = held_out_halves(held_out)
    fit = confidence_records(drafter, cache, to_draft, fitting, config)
    measure = confidence_records(drafter, cache, to_draft, measuring, config)
    temperatures = sequential_temperature_scaling(*fit.calibration())
    before = survival_ece(*measure.calibration(), [1.0] * drafter.block_size)
    after = survival_ece(*measure.calibration(), temperatures)
    drafter.config.confidence_temperatures = temperatures
    return before, after, temperatures, Acceptance.of(measure)


def held_out_halves(held_out: list[int]) -> tuple[list[int], list[int]]:
    """The held-out sequences STS is fitted on, and those acceptance and calibration error are measured on (the
    same ones where there is only one)."""
    half = max(1, len(held_out) // 2)
    return held_out[:half], held_out[half:] or held_out[:half]


@dataclass
class Acceptance:
    """Held-out acceptance by block position, each position's given the ones before it kept: under speculative
    sampling at temperature 1 (the mean of 1 - TV/2) and under greedy verification (the share of blocks whose
    earlier positions matched the target's argmax that match it here too). Greedy decoding commits what the second
    says, sampled decoding at temperature 1 the first."""

    sampled: list[float]
    greedy: list[float]

    @classmethod
    def of(cls, blocks: HeldOutBlocks) -> Acceptance:
        valid = blocks.valid
        kept_before = torch.cat([valid[:, :1], blocks.greedy.int().cumprod(dim=-1)[:, :-1].bool()], dim=-1)
        return cls(_means(blocks.sampled, valid), _means(blocks.greedy.float(), valid & kept_before))


def _means(values: torch.Tensor, where: torch.Tensor) -> list[float]:
    """Each position's mean of ``values`` [blocks, gamma] over the blocks ``where`` holds there (0 where none)."""
    return [values[where[:, k], k].mean().item() if where[:, k].any() else 0.0 for k in range(values.shape[1])]


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _autocast(config: DrafterTrainConfig, device: torch.device):
    return bfloat16_autocast(device, config.autocast)


def to_draft_index(vocab_size: int, draft_vocab: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Target id -> draft-vocabulary index, -1 for ids the draft vocabulary lacks."""
    if draft_vocab is None:
        return torch.arange(vocab_size, device=device)
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
    index[draft_vocab.to(device)] = torch.arange(len(draft_vocab), device=device)
    return index


def train_drafter(
    drafter: DSparkDrafter, cache: FeatureCache, training: list[int], config: DrafterTrainConfig
) -> tuple[list[float], int, list[dict[str, float]]]:
    """The loop: only the drafter's own parameters learn (the shared embedding and LM head are the target's).
    Returns each step's loss, the step it started at, and the learning curve."""
    drafter.train()
    to_draft = to_draft_index(drafter.config.vocab_size, drafter.vocab.ids, cache.tokens.device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = adamw(params, config.lr)
    start, curve = 0, []
    if has_checkpoint(config.output):
        folder = config.output / CHECKPOINT_DIR
        drafter.load_state_dict(DSparkDrafter.load(folder, *drafter.shared).state_dict())
        drafter.bind_vocab()
        start, curve = resume_trainer_state(folder, optimizer)
    rng = random.Random(config.seed + start)
    generator = torch.Generator().manual_seed(config.seed + start)
    losses: list[float] = []
    ema: dict[str, float] = {}
    started = time.perf_counter()
    with JobProgress() as progress:
        task = progress.add_job("train (dspark drafter)", total=config.steps, completed=start)
        for step in range(start, config.steps):
            rows = rng.sample(training, min(config.batch_size, len(training)))
            with _autocast(config, cache.tokens.device):
                blocks = block_forward(drafter, cache, to_draft, rows, config.anchors, generator)
                loss, values = block_losses(blocks, config)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config.steps, config.lr, config.warmup)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            losses.append(values["loss"])
            ema = {k: v if k not in ema else 0.98 * ema[k] + 0.02 * v for k, v in values.items()}
            progress.step(task, status=" ".join(f"{k}={v:.3f}" for k, v in ema.items()))
            done = step + 1 == config.steps or out_of_time(config.max_seconds, started)
            if (step + 1) % config.checkpoint_every == 0 or done:
                curve.append({"step": step + 1, "loss": ema["loss"], "tau": ema["tau"]})
                drafter.save(config.output / CHECKPOINT_DIR)
                save_trainer_state(config.output / CHECKPOINT_DIR, optimizer, config, step + 1, curve)
            if done:
                break
    drafter.eval()
    return losses, start, curve


def tokens_a_round(acceptance: list[float]) -> float:
    """Tokens a round with the whole block verified, bonus included: 1 plus the sum of the prefix survivals."""
    return 1.0 + sum(prefix_survival(acceptance))


def held_out_kinds(cache: FeatureCache, held_out: list[int]) -> dict[str, list[int]]:
    """Held-out sequences by corpus source, the part of their key before ``#`` (none where the cache has no keys)."""
    kinds: dict[str, list[int]] = {}
    for i in held_out if cache.keys is not None else []:
        kinds.setdefault(cache.keys[i].rsplit("#", 1)[0], []).append(i)
    return dict(sorted(kinds.items()))


def acceptance_of_kinds(
    drafter: DSparkDrafter,
    cache: FeatureCache,
    to_draft: torch.Tensor,
    kinds: dict[str, list[int]],
    config: DrafterTrainConfig,
) -> tuple[Acceptance, dict[str, Acceptance]]:
    """Acceptance by block position over all the kinds' sequences and on each kind's, from one pass over them (in
    training, both held-out halves: the temperatures STS fits on one half change the confidence, never the
    acceptance, so every held-out sequence is a fair measurement)."""
    rows = [row for chosen in kinds.values() for row in chosen]
    blocks = confidence_records(drafter, cache, to_draft, rows, config)
    measured = torch.tensor(rows)
    by_kind = {
        kind: Acceptance.of(blocks.of_rows(torch.isin(measured, torch.tensor(chosen))))
        for kind, chosen in kinds.items()
    }
    return Acceptance.of(blocks), by_kind


def trained_drafter(loaded: LoadedModel, folder: Path) -> DSparkDrafter:
    """A trained drafter folder beside ``loaded``, in float32 (training's and measuring's precision)."""
    return DSparkDrafter.load(folder, loaded.model.get_input_embeddings(), loaded.model.get_output_embeddings()).float()


def deepened(drafter: DSparkDrafter, layers: int | None) -> DSparkDrafter:
    """``drafter`` with backbone layers appended up to ``layers``, each a copy of its last layer whose attention
    and MLP output projections are zero: a residual block that adds nothing yet, so the deeper drafter drafts
    exactly as the trained one did and training goes on from there instead of from scratch. A layer costs a
    round one backbone layer more (about 0.24 ms on a 2-core AMD EPYC Zen 4, against a 4.4 ms target step)."""
    have = drafter.config.num_hidden_layers
    if layers is None or layers == have:
        return drafter
    if layers < have:
        raise ValueError(f"a {have}-layer drafter cannot continue with {layers} layers: layers are only added")
    for _ in range(layers - have):
        layer = copy.deepcopy(drafter.layers[-1])
        with torch.no_grad():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            if layer.self_attn.o_proj.bias is not None:
                layer.self_attn.o_proj.bias.zero_()
        drafter.layers.append(layer)
    drafter.config.num_hidden_layers = layers
    return drafter


def on_cache(drafter: DSparkDrafter, cache: FeatureCache, device: torch.device) -> DSparkDrafter:
    """The drafter on ``device`` with its vocabulary bound, once the cache is known to hold the layers it reads."""
    if drafter.config.target_layer_ids != cache.layer_ids:
        raise ValueError(f"the feature cache holds layers {cache.layer_ids}, not {drafter.config.target_layer_ids}")
    return drafter.to(device).bind_vocab()


@dataclass
class DrafterMeasurement:
    """A trained drafter's acceptance on the sequences of a feature cache it never trained on (``train measure``):
    how a shipped drafter does on new text, without training it."""

    drafter: str
    overall: KindAcceptance
    acceptance_by_kind: dict[str, KindAcceptance]


def measure(loaded: LoadedModel, cache: FeatureCache, folder: Path, config: DrafterTrainConfig) -> DrafterMeasurement:
    """Every sequence of ``cache`` that the drafter in ``folder`` did not record as trained on (all of them where the
    cache has no keys), at the seeded anchors the held-out measurements of training use."""
    drafter = trained_drafter(loaded, folder)
    on_cache(drafter, cache, loaded.device).eval()
    seen = read_trained_on(folder)
    unseen = [i for i in range(cache.sequences) if cache.keys is None or cache.keys[i] not in seen]
    if not unseen:
        raise ValueError(f"the drafter in {str(folder)!r} trained on every sequence of this feature cache")
    to_draft = to_draft_index(drafter.config.vocab_size, drafter.vocab.ids, cache.tokens.device)
    kinds = held_out_kinds(cache, unseen) or {"all": unseen}
    overall, by_kind = acceptance_of_kinds(drafter, cache, to_draft, kinds, config)
    return DrafterMeasurement(
        str(folder),
        KindAcceptance.of(len(unseen), overall, None),
        {kind: KindAcceptance.of(len(kinds[kind]), measured, None) for kind, measured in by_kind.items()},
    )


def run(
    loaded: LoadedModel, cache: FeatureCache, config: DrafterTrainConfig, draft_vocab: torch.Tensor | None
) -> DrafterTrainReport:
    """Drafter, loop, calibration, and the drafter folder (its own weights, bfloat16) with its report and curve."""
    torch.manual_seed(config.seed)
    loaded.model.requires_grad_(False)
    lineage = Lineage.split(cache.keys, cache.sequences, config.seed, config.holdout, config.init_from)
    held_out, training = lineage.held_out, lineage.training
    mask_token = loaded.tokenizer.pad_token_id
    if mask_token is None:
        mask_token = next(iter(loaded.eos_ids))
    if config.init_from is not None:
        drafter = deepened(trained_drafter(loaded, config.init_from), config.layers)
        drafter.config.confidence_temperatures = None  # STS is fitted again after training
    else:
        drafter = DSparkDrafter.for_target(
            loaded.model,
            mask_token,
            seed=config.seed,
            draft_vocab=draft_vocab,
            num_layers=config.layers or DEFAULT_LAYERS,
            block_size=config.block_size,
            markov_rank=config.markov_rank,
            target_layer_ids=config.target_layer_ids or cache.layer_ids,
        ).float()
    on_cache(drafter, cache, loaded.device)
    to_draft = to_draft_index(drafter.config.vocab_size, drafter.vocab.ids, cache.tokens.device)
    kinds = held_out_kinds(cache, held_out)
    initial, initial_by_kind = None, {}
    if config.init_from is not None:
        measuring = held_out_halves(held_out)[1]
        initial = Acceptance.of(confidence_records(drafter, cache, to_draft, measuring, config))
        initial_by_kind = acceptance_of_kinds(drafter, cache, to_draft, kinds, config)[1]
    started = time.perf_counter()
    losses, start, curve = train_drafter(drafter, cache, training, config)
    before, after, temperatures, acceptance = calibrate(drafter, cache, to_draft, held_out, config)
    drafter.save(config.output, dtype=torch.bfloat16)
    lineage.record(config.output, cache.keys)
    by_kind = {
        kind: KindAcceptance.of(len(kinds[kind]), measured, initial_by_kind.get(kind))
        for kind, measured in acceptance_of_kinds(drafter, cache, to_draft, kinds, config)[1].items()
    }
    report = DrafterTrainReport(
        steps=curve[-1]["step"] if curve else start,
        seconds=time.perf_counter() - started,
        first_loss=losses[0] if losses and start == 0 else float("nan"),
        final_loss=sum(losses[-10:]) / len(losses[-10:]) if losses else float("nan"),
        acceptance_by_position=acceptance.sampled,
        expected_tokens=tokens_a_round(acceptance.sampled),
        greedy_acceptance_by_position=acceptance.greedy,
        greedy_expected_tokens=tokens_a_round(acceptance.greedy),
        ece_before=before,
        ece_after=after,
        temperatures=temperatures,
        initial_acceptance_by_position=initial.sampled if initial else None,
        initial_greedy_acceptance_by_position=initial.greedy if initial else None,
        curve=curve,
        acceptance_by_kind=by_kind,
    )
    write_report(config.output, REPORT_FILE, report, CURVE_PLOT, "published drafter")
    return report
