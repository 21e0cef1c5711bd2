"""Span-aware training: next-token loss plus weighted next-k losses, from scratch or heads-only.

``scratch`` trains base and heads jointly on a corpus: loss = CE(next token) + sum_k w_k * CE(token k+1 ahead),
with w_k = decay**k. ``heads`` freezes a base model (a user's own Hugging Face model) and trains only the
heads; with self-distillation the targets are the base model's own greedy continuations, which is what exact
verification will compare drafts against, so it is the lever that raises acceptance the most.

Runs show progress, checkpoint every few hundred steps and resume from the last checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from backends.dspark.corpus import (
    DEFAULT_MIX,
    Mix,
    build_corpus,
    chat_openings,
    iter_chat_prompts,
    render_prompt,
    split_chat_document,
)
from backends.dspark.drills import iter_copy_drills
from backends.dspark.heads import CONFIG_FILE, DSparkConfig
from backends.dspark.model import DSparkModel
from backends.loading import LoadedModel, load_model
from backends.modelfactory import build_model, train_tokenizer
from backends.progress import JobProgress

IGNORE = -100
CHECKPOINT_DIR = "checkpoint"
TRAINER_STATE = "trainer_state.pt"
CURVE_FILE = "curve.json"


@dataclass
class TrainConfig:
    mode: Literal["scratch", "heads"]
    output: Path
    base_model: Path | None = None
    tokenizer: Path | None = None
    num_heads: int = 3
    loss_decay: float = 0.8
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 50
    checkpoint_every: int = 200
    seed: int = 0
    self_distill: int = 0
    distill_tokens: int = 96
    vocab_size: int = 4096
    hidden: int = 256
    layers: int = 4
    attention_heads: int = 4
    context: int = 1024
    mix: Mix = DEFAULT_MIX
    induction_rows: float = 0.0
    """Share of each batch's rows that are synthetic copy rows (:func:`induction_row`), not corpus text."""
    stop_at: int | None = None
    """Leave after this step (checkpointed), with the LR schedule still that of ``steps``: the first stage of a
    curriculum whose next stage resumes with other data."""


@dataclass
class TrainReport:
    steps: int
    seconds: float
    final_loss: float
    base_loss: float
    head_accuracy: list[float]
    base_accuracy: float
    # (step, smoothed loss, smoothed next-token accuracy) at every checkpoint, across resumed stages: the
    # learning curve, kept because a model card's final numbers cannot say whether more steps would help.
    curve: list[dict[str, float]] = field(default_factory=list)


def head_weights(num_heads: int, decay: float) -> list[float]:
    return [decay ** (k + 1) for k in range(num_heads)]


def span_losses(
    model: DSparkModel, input_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Cross-entropy of the base head (offset 1) and of each span head (offset k+2), with their accuracies.

    ``labels`` is ``input_ids`` with positions that are not targets (padding, prompts) set to IGNORE.
    """
    hidden = model.base(input_ids=input_ids).last_hidden_state
    logits = [model.lm_head(hidden), *model.heads(hidden, model.lm_head)]
    losses, accuracies = [], []
    for offset, head_logits in enumerate(logits, start=1):
        pred = head_logits[:, :-offset].reshape(-1, head_logits.shape[-1])
        target = labels[:, offset:].reshape(-1)
        losses.append(F.cross_entropy(pred.float(), target, ignore_index=IGNORE))
        keep = target != IGNORE
        accuracies.append((pred.argmax(-1)[keep] == target[keep]).float().mean())
    return losses[0], losses[1:], accuracies


def pack_documents(
    documents: Sequence[str], tokenizer, seq_len: int, pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) rows of ``seq_len`` tokens, each a run of whole documents (a document that does not fit
    opens the next row; a longer one is cut), so every answer is trained with its whole prompt in view.

    A chat document's prompt is tokenized on its own and left out of the loss: it is what serving tokenizes
    before generating, and its values (names, dates, code) are draws the model must copy, not predict. A
    document whose prompt alone fills a row is left out."""
    rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    ids: list[int] = []
    labels: list[int] = []

    def close_row() -> None:
        if ids:
            width = seq_len - len(ids)
            rows.append((torch.tensor(ids + [pad_id] * width), torch.tensor(labels + [IGNORE] * width)))
            ids.clear()
            labels.clear()

    for doc in documents:
        prompt, answer = split_chat_document(doc)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        answer_ids = tokenizer.encode(answer, add_special_tokens=False)
        if len(prompt_ids) >= seq_len:
            continue  # nothing of its answer would be trained, and a batch of such rows has no loss at all
        doc_ids = (prompt_ids + answer_ids)[:seq_len]
        doc_labels = ([IGNORE] * len(prompt_ids) + answer_ids)[:seq_len]
        if len(ids) + len(doc_ids) > seq_len:
            close_row()
        ids += doc_ids
        labels += doc_labels
    close_row()
    return rows


def induction_row(
    seq_len: int, token_ids: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels): random tokens in which every span comes back right after itself, labelled only where the
    repeat is predictable (from its second token on).

    The copy drills reward copying, but on text a model finds the circuit that copies (a previous-token head
    feeding an induction head) late: its loss falls faster by learning the templates and guessing their values.
    On these rows copying is the only thing to learn, and in short rows (32 tokens: attention at initialisation
    is spread over few positions, so the one that matches stands out) the circuit forms within a few hundred
    steps; in rows of 64 it had barely begun after 1,300, in rows of 256 not at all after 1,350. The drills and
    subtasks that follow keep it, since it lowers their loss too. Spans are up to a fifth of the row, each after
    up to half that of noise."""
    longest = max(2, seq_len // 5)
    ids: list[int] = []
    labels: list[int] = []
    while len(ids) < seq_len:
        noise = int(torch.randint(0, longest // 2 + 1, (1,), generator=generator))
        span = int(torch.randint(2, longest + 1, (1,), generator=generator))
        drawn = token_ids[torch.randint(0, len(token_ids), (noise + span,), generator=generator)].tolist()
        copied = drawn[noise:]
        ids += drawn + copied
        labels += [IGNORE] * (noise + span + 1) + copied[1:]
    return torch.tensor(ids[:seq_len]), torch.tensor(labels[:seq_len])


def with_induction_rows(
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]], share: float, tokenizer, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` with the first ``share`` of each batch's rows replaced by :func:`induction_row` rows."""
    special = set(tokenizer.all_special_ids)
    token_ids = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    generator = torch.Generator().manual_seed(seed)
    for ids, labels in batches:
        for r in range(round(share * len(ids))):
            ids[r], labels[r] = induction_row(ids.shape[1], token_ids, generator)
        yield ids, labels


def row_batches(
    rows: Sequence[tuple[torch.Tensor, torch.Tensor]], batch_size: int, rng: random.Random
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled epochs over packed rows, forever."""
    order = list(range(len(rows)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            picked = [rows[i] for i in order[start : start + batch_size]]
            yield torch.stack([r[0] for r in picked]), torch.stack([r[1] for r in picked])


def sequence_batches(
    sequences: Sequence[tuple[list[int], int]], batch_size: int, pad_id: int, rng: random.Random
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of (tokens, prompt_length) sequences, right-padded, with prompt and padding ignored."""
    while True:
        rows = rng.sample(list(sequences), min(batch_size, len(sequences)))
        width = max(len(tokens) for tokens, _ in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        for i, (tokens, prompt_len) in enumerate(rows):
            ids[i, : len(tokens)] = torch.tensor(tokens)
            labels[i, prompt_len : len(tokens)] = torch.tensor(tokens[prompt_len:])
        yield ids, labels


@torch.inference_mode()
def self_distillation_set(
    loaded: LoadedModel, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int = 32
) -> list[tuple[list[int], int]]:
    """The base model's own greedy continuations of ``prompts``: exactly what exact verification accepts."""
    tokenizer, model = loaded.tokenizer, loaded.model
    pad = tokenizer.pad_token_id
    out: list[tuple[list[int], int]] = []
    with JobProgress(log_every=batch_size * 8) as progress:
        task = progress.add_job("self-distillation", total=len(prompts))
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            generated = model.generate(
                input_ids=ids.to(loaded.device),
                attention_mask=mask.to(loaded.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            for i, p in enumerate(chunk):
                continuation = generated[i, width:].tolist()
                ends = [j for j, t in enumerate(continuation) if t in loaded.eos_ids]
                continuation = continuation[: ends[0] + 1] if ends else continuation
                out.append((p + continuation, len(p)))
            progress.step(task, len(chunk))
    return out


def _lr_at(step: int, config: TrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    model: DSparkModel,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    config: TrainConfig,
) -> TrainReport:
    """The training loop shared by both modes; only which parameters learn differs."""
    train_base = config.mode == "scratch"
    model.loaded.model.requires_grad_(train_base)
    model.loaded.model.train(train_base)
    model.heads.train()
    params = [p for p in [*model.loaded.model.parameters(), *model.heads.parameters()] if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.01, betas=(0.9, 0.95))
    weights = head_weights(model.dspark_config.num_heads, config.loss_decay)
    start_step = _resume(model, optimizer, config.output)
    curve = _resumed_curve(config.output, start_step)
    ema: dict[str, float] = {}
    started = time.perf_counter()
    with JobProgress() as progress:
        task = progress.add_job(f"train ({config.mode})", total=config.steps, completed=start_step)
        for step in range(start_step, config.stop_at or config.steps):
            ids, labels = next(batches)
            ids, labels = ids.to(model.loaded.device), labels.to(model.loaded.device)
            base_loss, head_losses, accuracies = span_losses(model, ids, labels)
            loss = sum(w * h for w, h in zip(weights, head_losses))
            if train_base:
                loss = loss + base_loss
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, config)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            values = {"loss": loss.item(), "base": base_loss.item()}
            values.update({f"acc{k + 1}": a.item() for k, a in enumerate(accuracies)})
            ema = {k: v if k not in ema else 0.95 * ema[k] + 0.05 * v for k, v in values.items()}
            status = " ".join(f"{k}={v:.3f}" for k, v in ema.items())
            progress.step(task, status=status)
            if (step + 1) % config.checkpoint_every == 0 or step + 1 in (config.steps, config.stop_at):
                curve.append({"step": step + 1, "loss": ema["loss"], "accuracy": ema.get("acc1", float("nan"))})
                _checkpoint(model, optimizer, config, step + 1, curve)
    model.loaded.model.eval()
    model.heads.eval()
    return TrainReport(
        steps=config.steps,
        seconds=time.perf_counter() - started,
        final_loss=ema.get("loss", float("nan")),
        base_loss=ema.get("base", float("nan")),
        head_accuracy=[ema.get(f"acc{k + 2}", float("nan")) for k in range(model.dspark_config.num_heads)],
        base_accuracy=ema.get("acc1", float("nan")),
        curve=curve,
    )


def save_trainer_state(folder: Path, optimizer: torch.optim.Optimizer, config: object, step: int) -> None:
    """Beside a checkpoint's weights: what resuming needs (optimizer, step) and the run's config, for the record.
    Every training command (span heads, published drafter) checkpoints this way."""
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, folder / TRAINER_STATE)
    (folder / "train_config.json").write_text(json.dumps(asdict(config), default=str, indent=2))


def resume_trainer_state(folder: Path, optimizer: torch.optim.Optimizer) -> int:
    """The step the checkpoint in ``folder`` reached, with the optimizer restored (the caller restores weights)."""
    state = torch.load(folder / TRAINER_STATE, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def has_checkpoint(output: Path) -> bool:
    return (output / CHECKPOINT_DIR / TRAINER_STATE).is_file()


def _checkpoint(
    model: DSparkModel, optimizer: torch.optim.Optimizer, config: TrainConfig, step: int, curve: list[dict[str, float]]
) -> None:
    folder = config.output / CHECKPOINT_DIR
    model.save(folder)
    save_trainer_state(folder, optimizer, config, step)
    (folder / CURVE_FILE).write_text(json.dumps(curve))


def _resumed_curve(output: Path, start_step: int) -> list[dict[str, float]]:
    """The learning curve of the stages before this one, up to the step it resumes from."""
    path = output / CHECKPOINT_DIR / CURVE_FILE
    if not start_step or not path.is_file():
        return []
    return [point for point in json.loads(path.read_text()) if point["step"] <= start_step]


def _resume(model: DSparkModel, optimizer: torch.optim.Optimizer, output: Path) -> int:
    if not has_checkpoint(output):
        return 0
    folder = output / CHECKPOINT_DIR
    resumed = DSparkModel.from_pretrained(folder, device=str(model.loaded.device))
    model.loaded.model.load_state_dict(resumed.loaded.model.state_dict())
    model.heads.load_state_dict(resumed.heads.state_dict())
    return resume_trainer_state(folder, optimizer)


def model_for(config: TrainConfig, texts: Sequence[str]) -> DSparkModel:
    """The model a run starts from: a fresh base (scratch), or for heads-only training the base with its heads
    when it already has as many (training continues) and with new ones otherwise: a base trained with
    ``num_heads=0``, since its heads are trained afresh on its own outputs anyway, and joint heads made each
    step of the base cost 1.6 times as much.

    A scratch run can reuse another model's tokenizer (``tokenizer``), which a draft model for assisted
    generation must share with its target."""
    if config.mode == "heads":
        if config.base_model is None:
            raise ValueError("heads-only training needs --model, the base model to put heads on")
        config_file = config.base_model / CONFIG_FILE
        if config_file.is_file() and DSparkConfig.load(config.base_model).num_heads == config.num_heads:
            return DSparkModel.from_pretrained(config.base_model, device="cpu")
        return DSparkModel.with_new_heads(load_model(config.base_model, device="cpu"), config.num_heads)
    if config.tokenizer is not None:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, local_files_only=True)
    else:
        tokenizer = train_tokenizer(texts, vocab_size=config.vocab_size)
    base = build_model(
        "llama",
        tokenizer,
        hidden=config.hidden,
        layers=config.layers,
        heads=config.attention_heads,
        context=config.context,
        seed=config.seed,
    )
    loaded = LoadedModel(
        model=base,
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        eos_ids=frozenset(base.generation_config.eos_token_id),
        max_context=config.context,
        path=config.output,
    )
    return DSparkModel.with_new_heads(loaded, config.num_heads)


def distillation_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Chat subtasks (what the DSpark pool serves), copy and schema drills, chat requests about unseen code and
    prose, and bare code and prose openings from the corpus: ``count`` subtasks and about 0.8x that of the rest."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    chats = [encode(ex.prompt) for ex in iter_chat_prompts(count, seed=seed + 1)]
    drills = [encode(render_prompt(messages)) for messages, _ in islice(iter_copy_drills(seed + 1), count // 8)]
    requests = [encode(prompt) for prompt in chat_openings(count // 4, seed + 1)]
    openings = [
        encode(doc)[:48] for doc in build_corpus(0, seed=seed + 1, code_chunks=count // 4, prose_chunks=count // 8)
    ]
    return chats + drills + requests + [o for o in openings if len(o) >= 8]


def run(config: TrainConfig, chat_examples: int = 20_000) -> TrainReport:
    """One whole training job: data, model, loop, and the trained folder (model card numbers included)."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    scratch_data = config.mode == "scratch" or not config.self_distill
    texts = build_corpus(chat_examples, seed=config.seed, mix=config.mix) if scratch_data else []
    model = model_for(config, texts)
    tokenizer = model.loaded.tokenizer
    if config.mode == "heads" and config.self_distill:
        prompts = distillation_prompts(tokenizer, config.self_distill, config.seed)
        sequences = self_distillation_set(model.loaded, prompts, config.distill_tokens)
        batches = sequence_batches(sequences, config.batch_size, tokenizer.pad_token_id, rng)
    else:
        rows = pack_documents(texts, tokenizer, config.seq_len, tokenizer.pad_token_id)
        batches = row_batches(rows, config.batch_size, rng)
        if config.induction_rows:
            batches = with_induction_rows(batches, config.induction_rows, tokenizer, config.seed)
    report = train(model, batches, config)
    model.save(config.output)
    (config.output / f"train_report_{config.mode}.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    if config.mode == "scratch" and len(report.curve) > 1:
        plot_curve(report.curve, config.output / "train_curve_scratch.png")
    return report


def plot_curve(curve: list[dict[str, float]], path: Path) -> None:
    """Loss and next-token accuracy by step, one picture for the model card: a base's, since heads trained on the
    base's own outputs see next-token accuracy 1.0 throughout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [point["step"] for point in curve]
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(9, 3.2))
    loss_axis.plot(steps, [point["loss"] for point in curve])
    loss_axis.set(xlabel="step", ylabel="training loss (nats, smoothed)")
    accuracy_axis.plot(steps, [point["accuracy"] for point in curve])
    accuracy_axis.set(xlabel="step", ylabel="next-token accuracy (smoothed)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
