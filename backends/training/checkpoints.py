"""Resumable training: what every training loop keeps beside its checkpointed weights, and its learning curve."""

from __future__ import annotations

import gzip
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from backends.corpus.recipe import source_family

CHECKPOINT_DIR = "checkpoint"
TRAINER_STATE = "trainer_state.pt"
CURVE_FILE = "curve.json"
TRAINED_ON_FILE = "trained_on.json.gz"
"""Beside a trained drafter: the keys of every corpus sequence it trained on, through every run it continues, so a
further run can sample text it never saw first (``train data --feature-lineage``) and measure on that."""


def adamw(params, lr: float) -> torch.optim.AdamW:
    """Both drafters' optimizer: AdamW without weight decay, betas (0.9, 0.95), fused into one kernel a step (on
    a 2-core CPU the per-tensor update was a fifth of the published drafter's step)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95), fused=True)


def save_trainer_state(folder: Path, optimizer: torch.optim.Optimizer, config: object, step: int, curve: list) -> None:
    """Optimizer, step and learning curve (what resuming needs), and the run's config for the record."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, folder / TRAINER_STATE)
    (folder / "train_config.json").write_text(json.dumps(asdict(config), default=str, indent=2))
    (folder / CURVE_FILE).write_text(json.dumps(curve))


def resume_trainer_state(folder: Path, optimizer: torch.optim.Optimizer) -> tuple[int, list]:
    """The step the checkpoint in ``folder`` reached and the curve so far, with the optimizer restored (the caller
    restores weights)."""
    state = torch.load(folder / TRAINER_STATE, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    curve_file = folder / CURVE_FILE
    return int(state["step"]), json.loads(curve_file.read_text()) if curve_file.is_file() else []


def read_trained_on(folder: Path) -> frozenset[str]:
    """What the drafter in ``folder`` trained on (nothing recorded: an empty set)."""
    path = folder / TRAINED_ON_FILE
    return frozenset(json.loads(gzip.decompress(path.read_bytes()))) if path.is_file() else frozenset()


def write_trained_on(folder: Path, keys: frozenset[str]) -> None:
    """``keys`` as :data:`TRAINED_ON_FILE` in ``folder``, sorted (the same set writes the same bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / TRAINED_ON_FILE).write_bytes(gzip.compress(json.dumps(sorted(keys)).encode(), mtime=0))


def out_of_time(max_seconds: float | None, started: float) -> bool:
    """Whether a run given ``max_seconds`` from ``started`` (``time.perf_counter``) has used them up."""
    return max_seconds is not None and time.perf_counter() - started > max_seconds


def has_checkpoint(output: Path) -> bool:
    return (output / CHECKPOINT_DIR / TRAINER_STATE).is_file()


def plot_curve(curve: list[dict[str, float]], path: Path, title: str) -> None:
    """Loss and expected accepted tokens per round (held-in, smoothed) by step: one picture for the model card."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [point["step"] for point in curve]
    figure, (loss_axis, tau_axis) = plt.subplots(1, 2, figsize=(9, 3.2))
    loss_axis.plot(steps, [point["loss"] for point in curve])
    loss_axis.set(xlabel="step", ylabel="training loss (smoothed)", title=title)
    tau_axis.plot(steps, [point["tau"] for point in curve])
    tau_axis.set(xlabel="step", ylabel="expected tokens per round (smoothed)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def shuffled(sequences: int, seed: int) -> list[int]:
    """Sequence indices in the order ``seed`` gives them: every split of a cache draws from this one order."""
    order = list(range(sequences))
    random.Random(seed).shuffle(order)
    return order


def split_sequences(sequences: int, seed: int, holdout: float) -> tuple[list[int], list[int]]:
    """(held out, training) sequence indices, shuffled by ``seed``; at least two held out."""
    order = shuffled(sequences, seed)
    held = max(2, int(len(order) * holdout))
    return order[:held], order[held:]


HELD_OUT_PER_FAMILY = 48
"""A continued run holds out at least this many sequences of each source family (subtask, stdlib, synth,
follow-up) its lineage never saw, or all of them where the cache has fewer: a sample mostly of one family still
measures the others, so a run that forgets one shows it before it is served."""


@dataclass(frozen=True)
class Lineage:
    """A run's split of its feature cache, given what its starting point (``init_from``) and every run before that
    trained on: only sequences the lineage never saw are held out, so before and after are measured on text it
    never saw, and the run's record is the lineage's plus its own training sequences (replayed ones included)."""

    earlier: frozenset[str]
    held_out: list[int]
    training: list[int]

    @classmethod
    def split(
        cls, keys: list[str] | None, sequences: int, seed: int, holdout: float, init_from: Path | None
    ) -> Lineage:
        earlier = read_trained_on(init_from) if init_from is not None else frozenset()
        if not earlier or keys is None:
            return cls(earlier, *split_sequences(sequences, seed, holdout))
        order = shuffled(sequences, seed)
        families: dict[str, list[int]] = {}
        for i in order:
            families.setdefault(source_family(keys[i]), []).append(i)
        held = set()
        for members in families.values():
            unseen = [i for i in members if keys[i] not in earlier]
            held.update(unseen[: max(int(len(members) * holdout), HELD_OUT_PER_FAMILY)])
        if not held:
            raise ValueError(f"{init_from} trained on every sequence of the cache: see train data --feature-lineage")
        return cls(earlier, [i for i in order if i in held], [i for i in order if i not in held])

    def record(self, output: Path, keys: list[str] | None) -> None:
        """The lineage's record with this run's training sequences, beside its weights in ``output`` (none where
        the cache predates keys)."""
        if keys is not None:
            write_trained_on(output, self.earlier | {keys[i] for i in self.training})


def write_report(output: Path, report_file: str, report: object, curve_plot: str, title: str) -> None:
    """A stage's report (a dataclass) as JSON and, once it has two points, its learning curve as a picture."""
    (output / report_file).write_text(json.dumps(asdict(report), indent=2) + "\n")
    if len(report.curve) > 1:
        plot_curve(report.curve, output / curve_plot, title)
