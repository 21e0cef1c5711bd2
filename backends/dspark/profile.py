"""Profile the target's steps per second by forward length, once per model and machine, for Algorithm 1.

What a verification token costs depends on the model, the device, the dtype and the threads, never on the
request, so it is measured once and kept as ``dspark_sps.json`` in the drafters' folder, one curve per machine
key. Re-run it after changing hardware or threads: ``python -m backends.dspark.profile MODEL_FOLDER``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from backends.batch_kv import BatchedKV
from backends.default_model import drafters_for
from backends.dspark.curves import machine_key, stored_curves
from backends.dspark.drafter import DSparkDrafter, target_features
from backends.dspark.published_decode import sample_block
from backends.engine import batch_kv
from backends.loading import LoadedModel, load_model
from backends.packed.kv import PackedKV
from backends.scheduling import PROFILE_FILE, SpsCurve
from backends.steps import ForwardOut
from backends.types import GenerationRequest

CONTEXT_TOKENS = 64
ONE_REQUEST = 16
"""The longest forward one request verifies (anchor plus draft), up to which every length is profiled."""


def loaded_key(loaded: LoadedModel) -> str:
    """:func:`~backends.dspark.curves.machine_key` of a loaded model, as it runs."""
    return machine_key(loaded.device, loaded.precision, loaded.threads)


def profiled_lengths(max_tokens: int) -> list[int]:
    """Every length up to 16 (one request's anchor plus draft), then a grid up to ``max_tokens`` (a whole batch:
    rows times anchor plus draft), between which :meth:`SpsCurve.at` interpolates."""
    lengths = list(range(1, min(max_tokens, ONE_REQUEST) + 1))
    while lengths[-1] < max_tokens:
        lengths.append(min(max_tokens, int(lengths[-1] * 1.5)))
    return lengths


@torch.inference_mode()
def measure_sps(loaded: LoadedModel, max_tokens: int, repeats: int = 15) -> SpsCurve:
    """Median time of a forward of 1..max_tokens tokens after a fixed context, as steps per second, through the
    batching engine's own forward (the packed engine's where it serves). A batched forward of R rows of n tokens is
    taken to cost what one of R * n tokens does.

    The lengths one request verifies (up to 16) are timed in ``repeats`` sweeps over all of them after an untimed
    one, as a decode loop alternates them, and each length's median kept; the batch-sized ones after them, the
    same way. Timed length by length, with one untimed call each, a machine's drift (clocks, the allocator
    settling on a width's buffers, a neighbour's load) lands on whichever lengths it hits: on a 2-core Xeon the
    one-token step came out at 165-229 steps/s run to run, against 270-290 in steady decoding, which made a
    verification of two tokens look cheaper than a plain step."""
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    kv, row, _ = _after_context(loaded, torch.randint(vocab, (CONTEXT_TOKENS,), generator=generator).tolist())
    lengths = profiled_lengths(max_tokens)
    inputs = {tokens: torch.randint(vocab, (tokens,), generator=generator).tolist() for tokens in lengths}
    times: dict[int, list[float]] = {tokens: [] for tokens in lengths}
    for group in ([n for n in lengths if n <= ONE_REQUEST], [n for n in lengths if n > ONE_REQUEST]):
        for sweep in range(repeats + 1):
            for tokens in group:
                seconds = _timed_s(partial(kv.step, [inputs[tokens]], True), loaded.device)
                kv.rewind(row, tokens)
                if sweep:
                    times[tokens].append(seconds)
    return SpsCurve({tokens: 1.0 / statistics.median(seconds) for tokens, seconds in times.items()})


def _after_context(loaded: LoadedModel, context: list[int]) -> tuple[BatchedKV | PackedKV, object, ForwardOut]:
    """A batch of one row that has run ``context`` (its outputs with every layer's states): where every profiled
    forward starts."""
    kv, row = batch_kv(loaded), object()
    return kv, row, kv.prefill([row], [context], hidden_states=True)[0]


@dataclass(frozen=True)
class RoundCosts:
    """Median milliseconds of each part of one published-drafter round on this machine, after a fixed context:
    the target's forward of one token (a plain decoding step) and of a full block with its features (a
    verification), and the drafter's context update, backbone pass, LM head (over its draft vocabulary), sequential
    Markov stage and confidences."""

    target_step_ms: float
    target_verify_ms: float
    context_ms: float
    backbone_ms: float
    lm_head_ms: float
    sequential_ms: float
    confidence_ms: float

    @property
    def draft_s(self) -> float:
        """What a round's drafting costs on top of its forward: what the verification budget weighs it against."""
        parts = (self.context_ms, self.backbone_ms, self.lm_head_ms, self.sequential_ms, self.confidence_ms)
        return sum(parts) / 1e3


@torch.inference_mode()
def measure_round(loaded: LoadedModel, drafter: DSparkDrafter, repeats: int = 5) -> RoundCosts:
    """Each part timed on its own, greedy, with the whole block drafted. Measured when a backend loads rather
    than stored, since the drafter's share belongs to the drafter, not the target."""
    gamma = drafter.block_size
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(vocab, (CONTEXT_TOKENS,), generator=generator).tolist()
    kv, row, out = _after_context(loaded, prompt)
    features = target_features(out.hidden_states, drafter.config.target_layer_ids)[0]
    context = drafter.new_context()
    drafter.extend_context(context, features)

    def forward(tokens: int, hidden_states: bool) -> tuple[Callable[[], object], Callable[[], object]]:
        """A forward of ``tokens`` after the context, and the rewind that takes them back out of the cache."""
        return partial(kv.step, [prompt[:tokens]], hidden_states), partial(kv.rewind, row, tokens)

    hidden = drafter.draft_hidden(context, 0)
    base = drafter.base_logits(hidden)
    prev_ids = torch.zeros(gamma, dtype=torch.long, device=loaded.device)
    greedy = GenerationRequest(prompt="profile", temperature=0.0)
    parts = {
        "target_step_ms": forward(1, False),
        "target_verify_ms": forward(gamma + 1, True),
        "context_ms": (lambda: drafter.extend_context(drafter.new_context(), features[:4]), None),
        "backbone_ms": (lambda: drafter.draft_hidden(context, 0), None),
        "lm_head_ms": (lambda: drafter.base_logits(hidden), None),
        "sequential_ms": (lambda: sample_block(drafter, base, 0, greedy, None), None),
        "confidence_ms": (lambda: drafter.confidence_logits(hidden, prev_ids), None),
    }
    costs = {name: 1e3 * _median_s(work, repeats, loaded.device, reset) for name, (work, reset) in parts.items()}
    return RoundCosts(**costs)


def _timed_s(work: Callable[[], object], device: torch.device) -> float:
    """Seconds ``work`` takes, waiting for a GPU's queued work before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _median_s(
    work: Callable[[], object], repeats: int, device: torch.device, reset: Callable[[], object] | None = None
) -> float:
    """The median of ``repeats`` timings after one untimed call; ``reset`` (a KV cache's crop) runs after each,
    untimed."""
    times = []
    for _ in range(repeats + 1):
        times.append(_timed_s(work, device))
        if reset is not None:
            reset()
    return statistics.median(times[1:])


def profile(folder: str | Path, loaded: LoadedModel, max_tokens: int) -> SpsCurve:
    """Measure now and store the curve under this machine's key (a read-only folder just keeps it in memory)."""
    folder = Path(folder)
    curve = measure_sps(loaded, max_tokens)
    stored = stored_curves(folder / PROFILE_FILE)
    stored[loaded_key(loaded)] = {str(k): v for k, v in curve.steps_per_s.items()}
    with contextlib.suppress(OSError):
        (folder / PROFILE_FILE).write_text(json.dumps(stored, indent=2) + "\n")
    return curve


def load_or_profile(folder: str | Path, loaded: LoadedModel, max_tokens: int) -> SpsCurve:
    """The stored curve for this machine when it covers ``max_tokens``, else a fresh measurement."""
    stored = stored_curves(Path(folder) / PROFILE_FILE).get(loaded_key(loaded))
    if stored and max(map(int, stored)) >= max_tokens:
        return SpsCurve.from_stored(stored)
    return profile(folder, loaded, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description="re-profile a target model's steps per second by forward length")
    parser.add_argument("model", help="target model folder")
    parser.add_argument("--into", help="where the profile is kept (default: the model's drafters' folder)")
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="longest forward: batch size times (1 + the drafter's block size)"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    curve = profile(args.into or drafters_for(args.model), loaded, args.max_tokens)
    print(json.dumps({"machine": loaded_key(loaded), "steps_per_s": curve.steps_per_s}, indent=2))


if __name__ == "__main__":
    main()
