"""Train span heads on a frozen target's cached last hidden states.

Head k maps the target's last hidden state at position t to token t+2+k (:mod:`backends.dspark.heads`); the
tokens are the target's own greedy answers (self-distillation), exactly what exact verification accepts. The
hidden states come from the feature cache, so no target forward runs while training: a step is the heads and
the draft vocabulary's LM-head rows over a few thousand answer positions.

Loss: sum over heads of decay**(k+1) * CE(head k, token t+2+k), over answer positions whose token the draft
vocabulary holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from backends.dspark.heads import SpanHeads
from backends.dspark.model import DSparkModel
from backends.loading import LoadedModel, bfloat16_autocast
from backends.progress import JobProgress
from backends.training.checkpoints import (
    CHECKPOINT_DIR,
    Lineage,
    adamw,
    has_checkpoint,
    out_of_time,
    resume_trainer_state,
    save_trainer_state,
    write_report,
)
from backends.training.drafter import lr_at, to_draft_index
from backends.training.features import FeatureCache

REPORT_FILE = "train_report_heads.json"
CURVE_PLOT = "train_curve_heads.png"


@dataclass
class HeadsTrainConfig:
    output: Path
    num_heads: int = 3
    steps: int = 1500
    positions: int = 2048
    """Answer positions per step."""
    lr: float = 2e-3
    warmup: int = 50
    loss_decay: float = 0.8
    checkpoint_every: int = 250
    holdout: float = 0.05
    seed: int = 0
    autocast: bool = True
    max_seconds: float | None = None
    """Stop after this long, keeping what was learnt (a leased GPU's time is fixed in advance)."""
    init_from: Path | None = None
    """A folder of trained span heads to continue from (their count, draft vocabulary and tuned thresholds) instead
    of fresh heads, as the published drafter's ``init_from``: heads that learnt one corpus go on over another."""


@dataclass
class HeadsTrainReport:
    steps: int
    seconds: float
    final_loss: float
    accuracy_by_head: list[float]
    """Held-out top-1 accuracy of head k against token t+2+k."""
    curve: list[dict[str, float]] = field(default_factory=list)
    initial_accuracy_by_head: list[float] | None = None
    """With ``init_from``: the starting heads' accuracy on the same held-out positions, before this run."""


def answer_positions(cache: FeatureCache, rows: list[int], reach: int) -> torch.Tensor:
    """Cache rows t of the answers of sequences ``rows`` whose next ``reach`` tokens are all answer tokens."""
    picked = []
    for index in rows:
        span = cache.span(index)
        first = span.start + int(cache.prompt_lens[index]) - 1
        picked.append(torch.arange(first, max(first, span.stop - reach), device=cache.tokens.device))  # none if shorter
    return torch.cat(picked)


def head_losses(
    heads: SpanHeads, cache: FeatureCache, to_draft: torch.Tensor, positions: torch.Tensor, decay: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weighted CE over the heads and each head's top-1 accuracy at ``positions``."""
    logits = heads(cache.final[positions].float())
    total = logits.new_zeros(())
    accuracies = []
    for k in range(heads.config.num_heads):
        labels = to_draft[cache.tokens[positions + 2 + k].long()]
        keep = labels >= 0
        ce = F.cross_entropy(logits[k][keep].float(), labels[keep])
        total = total + decay ** (k + 1) * ce
        accuracies.append((logits[k].argmax(-1) == labels).float().mean())
    return total, accuracies


def run(
    loaded: LoadedModel, cache: FeatureCache, config: HeadsTrainConfig, draft_vocab: torch.Tensor | None
) -> HeadsTrainReport:
    """Heads, loop, held-out accuracy, and the heads' files (bfloat16) with their report and curve."""
    torch.manual_seed(config.seed)
    loaded.model.requires_grad_(False)
    lm_head = loaded.model.get_output_embeddings()
    if config.init_from is not None:
        heads = SpanHeads.load(config.init_from, lm_head).float()
        draft_vocab = getattr(heads, "draft_vocab", None)
        config = replace(config, num_heads=heads.config.num_heads)
    else:
        heads = DSparkModel.with_new_heads(loaded, config.num_heads, draft_vocab).heads.float().to(loaded.device)
    heads.bind_vocab(lm_head)
    reach = config.num_heads + 2
    lineage = Lineage.split(cache.keys, cache.sequences, config.seed, config.holdout, config.init_from)
    held_out = answer_positions(cache, lineage.held_out, reach)
    training = answer_positions(cache, lineage.training, reach)
    to_draft = to_draft_index(lm_head.weight.shape[0], draft_vocab, cache.tokens.device)
    autocast = bfloat16_autocast(cache.tokens.device, config.autocast)
    initial = None
    if config.init_from is not None:
        initial = _held_out_accuracy(heads, cache, to_draft, held_out, config, autocast)
    heads.train()
    optimizer = adamw(heads.parameters(), config.lr)
    start, curve = 0, []
    if has_checkpoint(config.output):
        folder = config.output / CHECKPOINT_DIR
        heads.load_state_dict(SpanHeads.load(folder, lm_head).state_dict())
        start, curve = resume_trainer_state(folder, optimizer)
    generator = torch.Generator().manual_seed(config.seed + start)
    started = time.perf_counter()
    ema: dict[str, float] = {}
    with JobProgress() as progress:
        task = progress.add_job("train (span heads)", total=config.steps, completed=start)
        for step in range(start, config.steps):
            drawn = torch.randint(len(training), (config.positions,), generator=generator)
            picked = training[drawn.to(training.device)]
            with autocast:
                loss, accuracies = head_losses(heads, cache, to_draft, picked, config.loss_decay)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config.steps, config.lr, config.warmup)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
            optimizer.step()
            values = {"loss": loss.item(), **{f"acc{k + 2}": a.item() for k, a in enumerate(accuracies)}}
            ema = {k: v if k not in ema else 0.98 * ema[k] + 0.02 * v for k, v in values.items()}
            progress.step(task, status=" ".join(f"{k}={v:.3f}" for k, v in ema.items()))
            done = step + 1 == config.steps or out_of_time(config.max_seconds, started)
            if (step + 1) % config.checkpoint_every == 0 or done:
                tau = 1.0 + sum(
                    torch.tensor([ema[f"acc{k + 2}"] for k in range(j + 1)]).prod().item()
                    for j in range(config.num_heads)
                )
                curve.append({"step": step + 1, "loss": ema["loss"], "tau": tau})
                heads.save(config.output / CHECKPOINT_DIR)
                save_trainer_state(config.output / CHECKPOINT_DIR, optimizer, config, step + 1, curve)
            if done:
                break
    heads.eval()
    accuracy = _held_out_accuracy(heads, cache, to_draft, held_out, config, autocast)
    heads.save(config.output, dtype=torch.bfloat16)
    lineage.record(config.output, cache.keys)
    report = HeadsTrainReport(
        steps=curve[-1]["step"] if curve else start,
        seconds=time.perf_counter() - started,
        final_loss=ema.get("loss", float("nan")),
        accuracy_by_head=accuracy,
        curve=curve,
        initial_accuracy_by_head=initial,
    )
    write_report(config.output, REPORT_FILE, report, CURVE_PLOT, "span heads")
    return report


@torch.no_grad()
def _held_out_accuracy(
    heads: SpanHeads,
    cache: FeatureCache,
    to_draft: torch.Tensor,
    positions: torch.Tensor,
    config: HeadsTrainConfig,
    autocast: torch.autocast,
) -> list[float]:
    hits = torch.zeros(config.num_heads, device=positions.device)
    for chunk in positions.split(config.positions):
        with autocast:
            _, accuracies = head_losses(heads, cache, to_draft, chunk, config.loss_decay)
        hits += torch.stack(accuracies).float() * len(chunk)
    return (hits / max(1, len(positions))).tolist()
