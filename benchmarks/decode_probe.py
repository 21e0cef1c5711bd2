"""Teacher-forced drafter probes for ``bench decode``: every drafter's full block at every position of the
target's own greedy output, and how much of it greedy verification would keep.

A decoding run only shows the draft positions its schedule chose to verify, so it cannot say what a different
static threshold would have done. The probe drafts the whole block at every anchor of the greedy reference
(the autoregressive output) instead, so the threshold sweep (the paper's Figure 5) and the reliability of the
confidence (its Figure 6) are read off one pass rather than one decoding run per threshold. Teacher forcing
is exact where it matters: greedy verification keeps draft token k only if every earlier one equalled the
reference, and then the drafter's inputs (its context, the Markov head's previous token) are the reference's.
Rounds are taken at every anchor, not only where a decoding run's rounds happened to start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from backends.dspark.drafter import DSparkDrafter, target_features
from backends.dspark.model import DSparkModel
from backends.dspark.selection import SpanPolicy
from backends.loading import LoadedModel
from backends.scheduling import VerifySchedule
from backends.training.drafter import ECE_BINS, expected_calibration_error

THRESHOLDS = [round(0.05 * i, 2) for i in range(20)]
VerifiedAt = Callable[[float, torch.Tensor], int]
"""A drafter's static policy: draft tokens verified at a threshold, given one anchor's scores."""


@dataclass
class ProbeRows:
    """One row per anchor: the scores the drafter's static policy thresholds, and the accepted draft length."""

    scores: torch.Tensor
    """[anchors, block]: the heads' top-1 probabilities, or the published drafter's calibrated c_k."""
    matched: torch.Tensor
    """[anchors]: how many leading draft tokens equal the greedy reference."""
    raw_scores: torch.Tensor | None = None
    """[anchors, block]: the published drafter's c_k before Sequential Temperature Scaling."""

    @staticmethod
    def concat(rows: list[ProbeRows]) -> ProbeRows:
        raw = [r.raw_scores for r in rows if r.raw_scores is not None]
        return ProbeRows(
            torch.cat([r.scores for r in rows]),
            torch.cat([r.matched for r in rows]),
            torch.cat(raw) if raw and len(raw) == len(rows) else None,
        )


def leading_matches(draft: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per row of ``draft`` [anchors, block], the length of its prefix equal to ``reference`` (same shape)."""
    return (draft == reference).int().cumprod(dim=-1).sum(dim=-1)


@torch.inference_mode()
def probe_heads(model: DSparkModel, sequence: list[int], prompt_len: int, width: int) -> ProbeRows:
    """At committed position p the heads draft tokens p+2.. (p+1 is the target's own token); only anchors whose
    whole block lies inside the reference count, so the tail is not scored as rejections."""
    hidden, _ = model.forward(sequence, DynamicCache(config=model.config))
    top, draft = torch.softmax(model.heads(hidden)[:width].float(), dim=-1).max(dim=-1)
    draft = model.heads.vocab.target_ids(draft)
    anchors = torch.arange(prompt_len - 1, max(prompt_len - 1, len(sequence) - 1 - width))
    if not len(anchors):
        return ProbeRows(torch.empty(0, width), torch.empty(0, dtype=torch.long))
    ids = torch.tensor(sequence)
    offsets = torch.arange(width)
    reference = ids[anchors[:, None] + 2 + offsets]
    drafted = draft.T[anchors]
    return ProbeRows(top.T[anchors].cpu(), leading_matches(drafted.cpu(), reference))


@torch.inference_mode()
def probe_dspark(loaded: LoadedModel, drafter: DSparkDrafter, sequence: list[int], prompt_len: int) -> ProbeRows:
    """The anchor at position t (its context: features of positions before t) drafts t+1..t+gamma, one
    backbone pass per anchor as in decoding; the Markov head's previous tokens are the reference's."""
    gamma, device = drafter.block_size, loaded.device
    ids = torch.tensor([sequence], device=device)
    out = loaded.model(input_ids=ids, output_hidden_states=True)
    features = target_features(out.hidden_states, drafter.config.target_layer_ids)[0]
    context = drafter.new_context()
    drafter.extend_context(context, features[:prompt_len])
    drafts, logits = [], []
    for t in range(prompt_len, len(sequence) - gamma):
        hidden = drafter.draft_hidden(context, sequence[t])
        prev = ids[0, t : t + gamma]
        drafted = torch.argmax(drafter.base_logits(hidden) + drafter.markov_head(prev), dim=-1)
        drafts.append(drafter.vocab.target_ids(drafted))
        if drafter.confidence_head is not None:
            logits.append(drafter.confidence_logits(hidden, prev))
        drafter.extend_context(context, features[t : t + 1])
    if not drafts:
        return ProbeRows(torch.empty(0, gamma), torch.empty(0, dtype=torch.long))
    anchors = torch.arange(prompt_len, len(sequence) - gamma)
    reference = torch.tensor(sequence)[anchors[:, None] + 1 + torch.arange(gamma)]
    matched = leading_matches(torch.stack(drafts).cpu(), reference)
    if not logits:
        return ProbeRows(torch.ones(len(drafts), gamma), matched)
    calibrated = torch.stack(logits).cpu()
    # confidence_logits divides the raw logits by the STS temperatures; multiplying back undoes only that.
    temperatures = torch.tensor(drafter.config.confidence_temperatures or [1.0] * gamma)
    return ProbeRows(torch.sigmoid(calibrated), matched, torch.sigmoid(calibrated * temperatures[:gamma]))


def heads_verified(policy: SpanPolicy, threshold: float, scores: torch.Tensor) -> int:
    """Draft tokens the span heads would verify with every span length's threshold set to ``threshold``."""
    static = SpanPolicy(policy.span_lengths, {n: threshold for n in policy.span_lengths if n > 1})
    return static.choose(scores)[0] - 1


def dspark_verified(threshold: float, scores: torch.Tensor) -> int:
    """Draft tokens DeepSpec's static policy verifies: up to the first c_k below ``threshold``."""
    return VerifySchedule(threshold=threshold).length(scores.tolist(), scores.shape[0])


def threshold_sweep(rows: ProbeRows, verified_at: VerifiedAt) -> list[dict]:
    """Per static threshold: verified draft tokens per round, the share of them accepted, and the mean
    accepted length per round (bonus token included)."""
    sweep = []
    for threshold in THRESHOLDS:
        verified = torch.tensor([verified_at(threshold, row) for row in rows.scores], dtype=torch.long)
        accepted = torch.minimum(verified, rows.matched)
        total = int(verified.sum())
        sweep.append(
            {
                "threshold": threshold,
                "mean_verified": verified.float().mean().item() if len(verified) else 0.0,
                "acceptance_rate": accepted.sum().item() / total if total else None,
                "mean_accepted": 1.0 + accepted.float().mean().item() if len(accepted) else 1.0,
            }
        )
    return sweep


def conditional_acceptance(rows: ProbeRows) -> list[float | None]:
    """Acceptance at block position k given every earlier position accepted, over every anchor."""
    width = rows.scores.shape[1]
    reached = [(rows.matched >= k).sum().item() for k in range(width)]
    kept = [(rows.matched > k).sum().item() for k in range(width)]
    return [k / r if r else None for k, r in zip(kept, reached)]


def reliability(scores: torch.Tensor, matched: torch.Tensor) -> dict:
    """Predicted prefix survival a_k = prod c_i against whether the first k+1 draft tokens all survived, in
    equal-width bins, with the ECE over every (anchor, position)."""
    predicted = scores.cumprod(dim=-1).flatten()
    survived = (matched[:, None] > torch.arange(scores.shape[1])).float().flatten()
    bins = (predicted * ECE_BINS).long().clamp(max=ECE_BINS - 1)
    table = [
        {
            "bin": b,
            "count": int(chosen.sum()),
            "predicted": predicted[chosen].mean().item(),
            "observed": survived[chosen].mean().item(),
        }
        for b in range(ECE_BINS)
        if (chosen := bins == b).any()
    ]
    ece = expected_calibration_error(predicted, survived) if len(predicted) else None
    return {"ece": ece, "bins": table}


def summary(rows_by_set: dict[str, list[ProbeRows]], verified_at: VerifiedAt) -> dict:
    """The probe of one drafter: pooled threshold sweep and conditional acceptance, per-set acceptance, and the
    reliability of the published drafter's confidence (``after`` only when it carries STS temperatures)."""
    pooled = ProbeRows.concat([r for rows in rows_by_set.values() for r in rows])
    entry = {
        "anchors": len(pooled.matched),
        "conditional_acceptance": conditional_acceptance(pooled),
        "threshold_sweep": threshold_sweep(pooled, verified_at),
        "sets": {name: conditional_acceptance(ProbeRows.concat(rows)) for name, rows in rows_by_set.items()},
        "reliability": None,
    }
    if pooled.raw_scores is not None and len(pooled.matched):
        entry["reliability"] = {"before": reliability(pooled.raw_scores, pooled.matched)}
        if not torch.equal(pooled.raw_scores, pooled.scores):
            entry["reliability"]["after"] = reliability(pooled.scores, pooled.matched)
    return entry
