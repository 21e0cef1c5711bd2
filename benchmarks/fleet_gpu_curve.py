"""Measure a GPU's steps per second by forward length for a Llama-3.1-8B-shaped model, the check behind the GPU
profiles of ``bench fleet`` (``benchmarks/fleet_profiles/``).

A forward's time depends on the shapes, not on the weights' values, so the model is built here from its published
shape with random bfloat16 weights: nothing is downloaded. Each forward of n new tokens after a fixed context is
captured once in a CUDA graph and replayed, as serving engines run their decode steps; the median replay is kept.
Attention reads a 64-token context, as the project's own profiler does (``backends/dspark/profile.py``).

Runs on its own, with torch only (a GPU machine need not install the project):
``python benchmarks/fleet_gpu_curve.py --out h200.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B on Hugging Face).
SHAPE = {
    "hidden": 4096,
    "intermediate": 14336,
    "layers": 32,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "vocab": 128256,
}
CONTEXT = 64
REPLAYS = 20


def lengths(longest: int) -> list[int]:
    """Every length up to 16, then a grid growing by half: what the project's profiler measures."""
    out = list(range(1, 17))
    while out[-1] < longest:
        out.append(min(longest, int(out[-1] * 1.5)))
    return out


class Model:
    """The decoder's matrix work and attention at the published shape; norms and rotary embeddings are the few
    elementwise passes left out."""

    def __init__(self, device: torch.device) -> None:
        s, dt = SHAPE, torch.bfloat16
        q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=dt) * 0.02

        self.layers = [
            {
                "qkv": weight(q + 2 * kv, s["hidden"]),
                "o": weight(s["hidden"], q),
                "gate_up": weight(2 * s["intermediate"], s["hidden"]),
                "down": weight(s["hidden"], s["intermediate"]),
                "k": torch.randn(1, s["kv_heads"], CONTEXT, s["head_dim"], device=device, dtype=dt),
                "v": torch.randn(1, s["kv_heads"], CONTEXT, s["head_dim"], device=device, dtype=dt),
            }
            for _ in range(s["layers"])
        ]
        self.embed = weight(s["vocab"], s["hidden"])
        self.head = weight(s["vocab"], s["hidden"])
        self.parameters = sum(t.numel() for layer in self.layers for n, t in layer.items() if n not in ("k", "v"))
        self.parameters += self.embed.numel() + self.head.numel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = SHAPE
        n = ids.shape[0]
        x = self.embed[ids]
        for layer in self.layers:
            qkv = x @ layer["qkv"].T
            q, k, v = qkv.split([s["heads"] * s["head_dim"], *[s["kv_heads"] * s["head_dim"]] * 2], dim=-1)
            q = q.view(1, n, s["heads"], s["head_dim"]).transpose(1, 2)
            k = torch.cat([layer["k"], k.view(1, n, s["kv_heads"], s["head_dim"]).transpose(1, 2)], dim=2)
            v = torch.cat([layer["v"], v.view(1, n, s["kv_heads"], s["head_dim"]).transpose(1, 2)], dim=2)
            attention = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            x = x + attention.transpose(1, 2).reshape(n, -1) @ layer["o"].T
            gate, up = (x @ layer["gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"].T
        return x @ self.head.T


def replay_ms(model: Model, tokens: int, device: torch.device) -> float:
    ids = torch.randint(SHAPE["vocab"], (tokens,), device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model.forward(ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.forward(ids)
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--longest", type=int, default=4096, help="longest forward, in tokens")
    args = parser.parse_args()
    device = torch.device("cuda")
    started = time.perf_counter()
    model = Model(device)
    curve = {}
    for tokens in lengths(args.longest):
        curve[str(tokens)] = 1e3 / replay_ms(model, tokens, device)
        print(f"{tokens:>5} tokens: {1e3 / curve[str(tokens)]:.3f} ms", flush=True)
    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "shape": SHAPE,
        "parameters": model.parameters,
        "context": CONTEXT,
        "replays": REPLAYS,
        "steps_per_s": curve,
        "seconds": round(time.perf_counter() - started, 1),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
