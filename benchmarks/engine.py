"""``dspark-router bench engine``: what one forward costs, by the number of tokens in it, on each engine that can
serve the model, beside the weight-read floor measured in the same run.

Speculative decoding pays only where verifying k + 1 tokens costs about one step, and a step can only approach
the time it takes to read the weights once. So this benchmark reports, for the packed engine (the GGUF's own
blocks) and transformers (float32, and bfloat16 where the CPU has it):

- a forward of 1, 2, 4, 8 and 16 new tokens after a context of :data:`CONTEXT` tokens, median milliseconds,
  through the same batch object the decode engine drives (so the Python around the kernels is counted);
- the floor: a memory-read probe (a sum over a buffer the size of the weights a forward reads, as fast as this
  machine streams memory), and the step over it;
- verifying passes of 4 and 8 tokens over one step;
- where the packed engine's step goes: its weight matrices alone (each multiplied on its own), the kernel call
  (adding attention, norms and the rest), and the Python around it;
- the packed engine's step after contexts of :data:`CONTEXTS` tokens, beside the bytes of fp16 keys and values
  its attention reads there: past about a thousand tokens the cache is read as much as the weights, which a step
  after :data:`CONTEXT` tokens does not show;
- the packed engine's prefill, prompt tokens per second for prompts of :data:`PREFILLS` tokens;
- a noisy host (:mod:`benchmarks.engine_host`): decoding speed after the host process ran torch, numpy and
  llama.cpp work, against a clean process, in-process, through the gateway and on a Redis worker; idle CPU; how
  soon the console command answers.

Targets: a step within 1.25x of the floor, the kernel call within 1.3x of the weight matrices' time, prefill at
least 1,500 tokens/s on 2 cores, and the noisy host's (:data:`benchmarks.engine_host.TARGETS`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from backends.default_model import DEFAULT_MODEL
from backends.engine import batch_kv
from backends.loading import LoadedModel, load_model
from backends.packed.pool import default_threads
from backends.precision import cpu_chip, cpu_has_bf16
from backends.progress import JobProgress
from benchmarks.engine_host import format_lines
from benchmarks.engine_host import measure as measure_host
from benchmarks.engine_host import steps as host_steps
from benchmarks.output import write_json

CONTEXT = 256
TOKENS = (1, 2, 4, 8, 16)
CONTEXTS = (16, 256, 1024, 4096)
PREFILLS = (64, 256, 512)
TARGETS = {"step_over_floor": 1.25, "kernel_over_weights": 1.3, "prefill_tokens_per_s": 1500.0}


def median_ms(work: Callable[[], object], repeats: int, reset: Callable[[], object] | None = None) -> float:
    """Median of ``repeats`` timings after two untimed calls; ``reset`` runs untimed after each."""
    times = []
    for i in range(repeats + 2):
        started = time.perf_counter()
        work()
        if i >= 2:
            times.append(time.perf_counter() - started)
        if reset is not None:
            reset()
    return 1e3 * statistics.median(times)


def read_floor_ms(size_bytes: int, repeats: int) -> float:
    """The time to read ``size_bytes`` once: a float32 sum over a buffer that size (cold to the cache: two buffers
    taken in turn, each larger than the caches a core owns)."""
    buffers = [torch.ones(size_bytes // 4) for _ in range(2)]
    turn = itertools.count()
    return median_ms(lambda: buffers[next(turn) % 2].sum(), repeats)


def forward_costs(
    loaded: LoadedModel, repeats: int, context: int = CONTEXT, tokens: tuple[int, ...] = TOKENS
) -> dict[int, float]:
    """Median ms of a forward of n tokens after ``context`` tokens, every layer's states kept (as a verification
    asks)."""
    kv, row = batch_kv(loaded), object()
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    kv.prefill([row], [torch.randint(vocab, (context,), generator=generator).tolist()])
    costs = {}
    for n in tokens:
        ids = torch.randint(vocab, (n,), generator=generator).tolist()
        costs[n] = median_ms(lambda ids=ids: kv.step([ids], True), repeats, reset=lambda n=n: kv.rewind(row, n))
    return costs


def step_by_context(loaded: LoadedModel, repeats: int) -> dict[int, dict[str, float]]:
    """A one-token step's and a verifying pass of 8 tokens' median ms after each of :data:`CONTEXTS` tokens, and
    the MB of keys and values (every layer's, as the engine stores them: its own cache of one chunk of positions
    gives the bytes a position takes) a token's attention reads there."""
    keys, values = loaded.packed.new_cache(1)
    cache_bytes = (keys.nbytes + values.nbytes) / values.shape[2]
    costs = {}
    for context in CONTEXTS:
        ms = forward_costs(loaded, repeats, context, (1, 8))
        costs[context] = {"step_ms": ms[1], "verify8_ms": ms[8], "cache_mb": cache_bytes * context / 1e6}
    return costs


def prefill_speed(loaded: LoadedModel, repeats: int) -> dict[int, float]:
    """Prompt tokens per second of a prefill of each of :data:`PREFILLS` tokens, through the batch object (only the
    last position's logits, as the engine asks)."""
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(1)
    speeds = {}
    for n in PREFILLS:
        prompt = torch.randint(vocab, (n,), generator=generator).tolist()

        def prefill(prompt=prompt) -> None:
            kv = batch_kv(loaded)
            kv.prefill([object()], [prompt])

        speeds[n] = n / (median_ms(prefill, max(3, repeats // 5)) / 1e3)
    return speeds


def packed_breakdown(loaded: LoadedModel, repeats: int) -> dict[str, float]:
    """One token's step on the packed engine, split: every weight matrix multiplied on its own (the LM head apart),
    the whole kernel call, and the Python batch object around it."""
    packed = loaded.packed
    engine, shape = packed.engine, packed.shape
    widths = [shape.hidden] * 2 + [shape.hidden, shape.heads * shape.head_dim, shape.hidden, shape.ffn] * shape.layers
    inputs = [torch.randn(1, k) for k in widths]
    layers = median_ms(lambda: [engine.matmul(i, x) for i, x in enumerate(inputs) if i >= 2], repeats)
    lm_head = median_ms(lambda: engine.matmul(1, inputs[1]), repeats)
    cache = packed.new_cache(CONTEXT + 1)
    context = torch.arange(CONTEXT)
    packed.forward(context, torch.zeros(CONTEXT, dtype=torch.long), context, [cache])
    one = (torch.tensor([7]), torch.zeros(1, dtype=torch.long), torch.tensor([CONTEXT]))
    kernel = median_ms(lambda: packed.forward(*one, [cache]), repeats)
    return {"layer_weights_ms": layers, "lm_head_ms": lm_head, "kernel_call_ms": kernel}


def measure(model: Path, repeats: int) -> dict:
    """Every engine's costs."""
    engines = {"packed": "gguf", "transformers_float32": "float32"}
    if cpu_has_bf16():
        engines["transformers_bfloat16"] = "bfloat16"
    report: dict = {"cpu": cpu_chip(), "threads": default_threads(), "context": CONTEXT, "engines": {}}
    for name, dtype in engines.items():
        loaded = load_model(model, device="cpu", dtype=dtype)
        costs = forward_costs(loaded, repeats)
        entry = {"forward_ms": costs, "verify4_steps": costs[4] / costs[1], "verify8_steps": costs[8] / costs[1]}
        if loaded.packed is not None:
            floor = read_floor_ms(loaded.packed.weight_bytes, repeats)
            breakdown = packed_breakdown(loaded, repeats)
            prefill = prefill_speed(loaded, repeats)
            weights = breakdown["layer_weights_ms"] + breakdown["lm_head_ms"]
            entry |= {
                "kernels": loaded.packed.engine.kernels,
                "threads": loaded.threads,
                "weight_bytes": loaded.packed.weight_bytes,
                "read_floor_ms": floor,
                "step_over_floor": costs[1] / floor,
                "breakdown": breakdown,
                "kernel_over_weights": breakdown["kernel_call_ms"] / weights,
                "prefill_tokens_per_s": prefill,
                "step_by_context": step_by_context(loaded, repeats),
                "targets": TARGETS,
                "met": {
                    "step_over_floor": costs[1] / floor <= TARGETS["step_over_floor"],
                    "kernel_over_weights": breakdown["kernel_call_ms"] / weights <= TARGETS["kernel_over_weights"],
                    "prefill_tokens_per_s": min(prefill.values()) >= TARGETS["prefill_tokens_per_s"],
                },
            }
        report["engines"][name] = entry
    return report


def format_table(report: dict) -> str:
    lines = [
        f"{report['cpu']}, {report['threads']} threads, context {report['context']}",
        f"{'engine':<22}" + "".join(f"{n:>6}" for n in TOKENS) + "  v4/1  v8/1",
    ]
    for name, entry in report["engines"].items():
        costs = entry["forward_ms"]
        cells = "".join(f"{costs[n]:6.1f}" for n in TOKENS)
        lines.append(f"{name:<22}{cells}{entry['verify4_steps']:6.2f}{entry['verify8_steps']:6.2f}")
    packed = report["engines"].get("packed")
    if packed:
        b = packed["breakdown"]
        lines.append(
            f"floor {packed['read_floor_ms']:.1f} ms ({packed['weight_bytes'] / 1e6:.0f} MB read); "
            f"step {packed['step_over_floor']:.2f}x it"
        )
        lines.append(
            f"one step: layer weights {b['layer_weights_ms']:.1f}, LM head {b['lm_head_ms']:.1f}, "
            f"kernel call {b['kernel_call_ms']:.1f} ms ({packed['kernels']}; "
            f"{packed['kernel_over_weights']:.2f}x the weights)"
        )
        lines.append(
            "prefill: " + ", ".join(f"{n} tokens {s:,.0f}/s" for n, s in packed["prefill_tokens_per_s"].items())
        )
        for name, key in (("step", "step_ms"), ("pass of 8", "verify8_ms")):
            lines.append(
                f"{name} after context: "
                + ", ".join(f"{n}: {c[key]:.1f}" for n, c in packed["step_by_context"].items())
                + " ms"
            )
    if "host" in report:
        lines += format_lines(report["host"])
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, entry in report["engines"].items():
        ax.plot(TOKENS, [entry["forward_ms"][n] for n in TOKENS], marker="o", label=name)
    packed = report["engines"].get("packed")
    if packed:
        ax.axhline(packed["read_floor_ms"], color="grey", linestyle="--", label="weight-read floor (packed)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(TOKENS, [str(n) for n in TOKENS])
    ax.set_xlabel("tokens in the forward")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"Forward cost, {report['cpu']}, {report['threads']} threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument(
        "--no-host", dest="host", action="store_false", help="skip the noisy host (about 5 minutes on 2 cores)"
    )


def run(args: argparse.Namespace) -> int:
    report = measure(args.model, args.repeats)
    if args.host:
        with JobProgress(log_every=1) as progress:
            job = progress.add_job("noisy host", total=host_steps())
            report["host"] = measure_host(lambda status: progress.step(job, status=status))
    print(format_table(report))
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    return 0
