"""Train the published DSpark drafter on a frozen target, then calibrate its confidence head.

Data is self-distillation: the target's own greedy continuations of a broad prompt mix generated here (chat
subtasks, code and prose openings; never the shared evaluation prompts), which is exactly what verification
will compare drafts against. Each sequence contributes blocks at random anchor positions in its continuation,
all drafted in one backbone pass (a mask keeps each block to its own tokens and the context before its anchor).

Loss, per block position k with weight w_k = exp(-(k-1)/decay), as DeepSpec's:
0.1 * CE(draft, target's token) + 0.9 * ||p_draft - p_target||_1 + 1.0 * BCE(c_k, 1 - ||p_draft - p_target||_1 / 2),
the last term's label being the probability that speculative sampling accepts token k. Afterwards Sequential
Temperature Scaling fits one temperature per position on half of the held-out sequences, so the prefix survival
a_k = prod c_i that Algorithm 1 ranks by is calibrated; the other half measures the ECE before and after.

Runs show progress, checkpoint every few hundred steps and resume from the last checkpoint, as ``train`` does.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from backends.dspark.drafter import DSparkDrafter, target_features
from backends.dspark.train import (
    CHECKPOINT_DIR,
    distillation_prompts,
    has_checkpoint,
    resume_trainer_state,
    save_trainer_state,
    self_distillation_set,
)
from backends.loading import LoadedModel, load_model
from backends.progress import JobProgress

DISTILL_FILE = "distillation.json"
REPORT_FILE = "train_report_dspark.json"
TEMPERATURE_GRID = [round(0.25 * 1.05**i, 4) for i in range(58)]
ECE_BINS = 10

Sequences = list[tuple[list[int], int]]


@dataclass
class DrafterTrainConfig:
    target: Path
    output: Path
    steps: int = 2000
    batch_size: int = 8
    anchors: int = 16
    lr: float = 6e-4
    warmup: int = 50
    checkpoint_every: int = 200
    seed: int = 0
    prompts: int = 2000
    distill_tokens: int = 96
    holdout: float = 0.1
    block_size: int = 7
    layers: int = 2
    markov_rank: int = 256
    target_layer_ids: list[int] | None = None
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    loss_decay: float = 7.0


@dataclass
class DrafterTrainReport:
    steps: int
    seconds: float
    first_loss: float
    final_loss: float
    acceptance_by_position: list[float]
    """Held-out mean of 1 - TV/2 per block position: the draft's acceptance rate there under sampling."""
    ece_before: float
    ece_after: float
    temperatures: list[float] = field(default_factory=list)


@dataclass
class BlockBatch:
    """Everything one training forward yields, per (sequence, block, position)."""

    draft_logits: torch.Tensor
    target_logits: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor
    confidence_logits: torch.Tensor


def pad_batch(rows: Sequences, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and the continuation mask (the tokens a block may be asked to draft)."""
    width = max(len(tokens) for tokens, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    continuation = torch.zeros_like(ids, dtype=torch.bool)
    for i, (tokens, prompt_len) in enumerate(rows):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        attention[i, : len(tokens)] = 1
        continuation[i, prompt_len : len(tokens)] = True
    return ids, attention, continuation


def sample_anchors(continuation: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``count`` anchors per row [B, count] where the anchor and the token after it are continuation;
    rows with fewer repeat some (harmless duplicates of a block, weighted as the others)."""
    valid = continuation[:, :-1] & continuation[:, 1:]
    scores = torch.rand(valid.shape, generator=generator).masked_fill(~valid, -1.0)
    order = scores.argsort(dim=1, descending=True)
    have = valid.sum(dim=1, keepdim=True).clamp_min(1)
    picks = torch.arange(count).unsqueeze(0) % have
    return order.gather(1, picks)


def block_forward(
    drafter: DSparkDrafter, loaded: LoadedModel, rows: Sequences, anchors_per_row: int, generator: torch.Generator
) -> BlockBatch:
    """Target features (no grad) then one drafter pass over every block of the batch, teacher-forced."""
    device, gamma = loaded.device, drafter.block_size
    ids, attention, continuation = pad_batch(rows, loaded.tokenizer.pad_token_id)
    anchors = sample_anchors(continuation, anchors_per_row, generator).to(device)
    ids, attention, continuation = ids.to(device), attention.to(device), continuation.to(device)
    batch, width = ids.shape
    with torch.no_grad():
        out = loaded.model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        features = target_features(out.hidden_states, drafter.config.target_layer_ids)
    positions = torch.arange(width, device=device).expand(batch, -1)
    context = drafter.context_keys_values(features, positions)
    offsets = torch.arange(gamma, device=device)
    block_pos = (anchors.unsqueeze(-1) + offsets).view(batch, -1)
    block_ids = torch.full_like(block_pos, drafter.config.mask_token_id)
    block_ids.view(batch, -1, gamma)[..., 0] = ids.gather(1, anchors)
    block_of = torch.arange(block_pos.shape[1], device=device) // gamma
    sees_context = positions.unsqueeze(1) < anchors.repeat_interleave(gamma, dim=1).unsqueeze(-1)
    sees_block = (block_of.unsqueeze(1) == block_of.unsqueeze(0)).expand(batch, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1).unsqueeze(1)
    hidden = drafter.backbone(block_ids, block_pos, context, mask).view(batch, -1, gamma, drafter.config.hidden_size)
    label_pos = anchors.unsqueeze(-1) + offsets + 1
    safe = label_pos.clamp(max=width - 1)
    labels = ids.gather(1, safe.view(batch, -1)).view_as(safe)
    valid = (label_pos < width) & continuation.gather(1, safe.view(batch, -1)).view_as(safe)
    valid = valid.int().cumprod(dim=-1).bool()
    prev = torch.cat([ids.gather(1, anchors).unsqueeze(-1), labels[..., :-1]], dim=-1)
    draft_logits = drafter.base_logits(hidden) + drafter.markov_head(prev)
    target_logits = out.logits.gather(1, (safe - 1).view(batch, -1, 1).expand(-1, -1, out.logits.shape[-1]))
    confidence = drafter.confidence_logits(hidden, prev) if drafter.confidence_head is not None else None
    return BlockBatch(draft_logits, target_logits.view_as(draft_logits), labels, valid, confidence)


def block_losses(blocks: BlockBatch, config: DrafterTrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    gamma = blocks.labels.shape[-1]
    decay = torch.exp(-torch.arange(gamma, device=blocks.labels.device) / config.loss_decay)
    weights = blocks.valid.float() * decay
    total = weights.sum().clamp_min(1e-6)
    draft_probs = torch.softmax(blocks.draft_logits.float(), dim=-1)
    target_probs = torch.softmax(blocks.target_logits.float(), dim=-1)
    l1 = (draft_probs - target_probs).abs().sum(dim=-1)
    ce = F.cross_entropy(blocks.draft_logits.float().flatten(0, -2), blocks.labels.flatten(), reduction="none")
    ce_loss = (ce.view_as(weights) * weights).sum() / total
    tv_loss = (l1 * weights).sum() / total
    loss = config.ce_weight * ce_loss + config.tv_weight * tv_loss
    values = {"ce": ce_loss.item(), "tv": tv_loss.item()}
    if blocks.confidence_logits is not None:
        label = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
        bce = F.binary_cross_entropy_with_logits(blocks.confidence_logits, label, reduction="none")
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
    scaled = torch.sigmoid(logits / torch.tensor(temperatures))
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
            predicted = torch.sigmoid(logits[:, : k + 1] / torch.tensor(trial[: k + 1])).cumprod(dim=-1)[:, k]
            target = labels[:, : k + 1].cumprod(dim=-1)[:, k]
            return expected_calibration_error(predicted[valid[:, k]], target[valid[:, k]])

        temperatures[k] = min([1.0, *TEMPERATURE_GRID], key=ece_at)
    return temperatures


@torch.no_grad()
def confidence_records(
    drafter: DSparkDrafter, loaded: LoadedModel, sequences: Sequences, config: DrafterTrainConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw confidence logits, acceptance labels 1 - TV/2 and validity [blocks, gamma] on ``sequences``."""
    saved, drafter.config.confidence_temperatures = drafter.config.confidence_temperatures, None
    generator = torch.Generator().manual_seed(config.seed + 1)
    logits, labels, valid = [], [], []
    for start in range(0, len(sequences), config.batch_size):
        blocks = block_forward(drafter, loaded, sequences[start : start + config.batch_size], config.anchors, generator)
        l1 = (torch.softmax(blocks.draft_logits.float(), -1) - torch.softmax(blocks.target_logits.float(), -1)).abs()
        logits.append(blocks.confidence_logits.flatten(0, 1).cpu())
        labels.append((1.0 - 0.5 * l1.sum(-1)).clamp(0.0, 1.0).flatten(0, 1).cpu())
        valid.append(blocks.valid.flatten(0, 1).cpu())
    drafter.config.confidence_temperatures = saved
    return torch.cat(logits), torch.cat(labels), torch.cat(valid)


def calibrate(
    drafter: DSparkDrafter, loaded: LoadedModel, held_out: Sequences, config: DrafterTrainConfig
) -> tuple[float, float, list[float], list[float]]:
    """Fit temperatures on one half of ``held_out``, measure ECE before/after on the other; set them on the
    drafter. Also returns the per-position acceptance on the measuring half."""
    half = max(1, len(held_out) // 2)
    fit = confidence_records(drafter, loaded, held_out[:half], config)
    measure = confidence_records(drafter, loaded, held_out[half:] or held_out[:half], config)
    temperatures = sequential_temperature_scaling(*fit)
    before = survival_ece(*measure, [1.0] * drafter.block_size)
    after = survival_ece(*measure, temperatures)
    drafter.config.confidence_temperatures = temperatures
    _, labels, valid = measure
    acceptance = [labels[valid[:, k], k].mean().item() if valid[:, k].any() else 0.0 for k in range(labels.shape[1])]
    return before, after, temperatures, acceptance


def _lr_at(step: int, config: DrafterTrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def distillation_data(loaded: LoadedModel, config: DrafterTrainConfig) -> Sequences:
    """The target's continuations, generated once per output folder and kept there, so a resumed run reuses them."""
    file = config.output / DISTILL_FILE
    if file.is_file():
        return [(tokens, prompt_len) for tokens, prompt_len in json.loads(file.read_text())]
    prompts = distillation_prompts(loaded.tokenizer, config.prompts, config.seed)
    sequences = [s for s in self_distillation_set(loaded, prompts, config.distill_tokens) if len(s[0]) > s[1] + 1]
    random.Random(config.seed).shuffle(sequences)
    config.output.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(sequences))
    return sequences


def train_drafter(
    drafter: DSparkDrafter, loaded: LoadedModel, sequences: Sequences, config: DrafterTrainConfig
) -> tuple[list[float], int]:
    """The loop: only the drafter's own parameters learn. Returns each step's loss and the step it started at."""
    loaded.model.requires_grad_(False)
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95))
    start = _resume(drafter, optimizer, config.output)
    rng = random.Random(config.seed + start)
    generator = torch.Generator().manual_seed(config.seed + start)
    losses: list[float] = []
    ema: dict[str, float] = {}
    with JobProgress() as progress:
        task = progress.add_job("train (dspark drafter)", total=config.steps, completed=start)
        for step in range(start, config.steps):
            rows = rng.sample(sequences, min(config.batch_size, len(sequences)))
            loss, values = block_losses(block_forward(drafter, loaded, rows, config.anchors, generator), config)
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, config)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            losses.append(values["loss"])
            ema = {k: v if k not in ema else 0.95 * ema[k] + 0.05 * v for k, v in values.items()}
            progress.step(task, status=" ".join(f"{k}={v:.3f}" for k, v in ema.items()))
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
                _checkpoint(drafter, optimizer, config, step + 1)
    drafter.eval()
    return losses, start


def _checkpoint(
    drafter: DSparkDrafter, optimizer: torch.optim.Optimizer, config: DrafterTrainConfig, step: int
) -> None:
    folder = config.output / CHECKPOINT_DIR
    drafter.save(folder)
    save_trainer_state(folder, optimizer, config, step)


def _resume(drafter: DSparkDrafter, optimizer: torch.optim.Optimizer, output: Path) -> int:
    if not has_checkpoint(output):
        return 0
    folder = output / CHECKPOINT_DIR
    drafter.load_state_dict(DSparkDrafter.load(folder, *drafter.shared).state_dict())
    return resume_trainer_state(folder, optimizer)


def run(config: DrafterTrainConfig) -> DrafterTrainReport:
    """Data, drafter, loop, calibration, and the drafter folder in the published layout with its report."""
    torch.manual_seed(config.seed)
    loaded = load_model(config.target, device="cpu")
    sequences = distillation_data(loaded, config)
    held = max(2, int(len(sequences) * config.holdout))
    held_out, training = sequences[:held], sequences[held:]
    mask_token = loaded.tokenizer.pad_token_id
    if mask_token is None:
        mask_token = next(iter(loaded.eos_ids))
    drafter = DSparkDrafter.for_target(
        loaded.model,
        mask_token,
        seed=config.seed,
        num_layers=config.layers,
        block_size=config.block_size,
        markov_rank=config.markov_rank,
        target_layer_ids=config.target_layer_ids,
    )
    started = time.perf_counter()
    losses, start = train_drafter(drafter, loaded, training, config)
    before, after, temperatures, acceptance = calibrate(drafter, loaded, held_out, config)
    drafter.save(config.output)
    report = DrafterTrainReport(
        steps=config.steps,
        seconds=time.perf_counter() - started,
        first_loss=losses[0] if losses and start == 0 else float("nan"),
        final_loss=sum(losses[-10:]) / len(losses[-10:]) if losses else float("nan"),
        acceptance_by_position=acceptance,
        ece_before=before,
        ece_after=after,
        temperatures=temperatures,
    )
    (config.output / REPORT_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report
