"""``bench batching`` end to end on a tiny model with span heads: every contender's figures, the JSON, the plot."""

from __future__ import annotations

import argparse
import json

from backends.dspark.heads import DSparkConfig, SpanHeads
from backends.loading import load_model
from backends.modelfactory import save_pretrained
from benchmarks import batching


def test_bench_batching_reports_every_contender_at_every_level(tiny_model_paths, tmp_path, capsys):
    loaded = load_model(tiny_model_paths["llama"])
    folder = save_pretrained(loaded.model, loaded.tokenizer, tmp_path / "model")
    SpanHeads(DSparkConfig(num_heads=3, hidden_size=loaded.model.config.hidden_size)).save(folder)
    parser = argparse.ArgumentParser()
    batching.add_arguments(parser)
    contenders = "batched,sequential,dspark_scheduled,dspark_fixed"
    files = ["--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    small = ["--concurrency", "1,3", "--window", "0.4", "--per-set", "1", "--max-tokens", "8"]
    args = parser.parse_args(["--model", str(folder), "--contenders", contenders, *small, *files])
    assert batching.run(args) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["drafter"] == "heads" and set(report["concurrency"]) == {"1", "3"}
    for row in report["concurrency"].values():
        for name in contenders.split(","):
            assert row[f"{name}_tokens_per_s"] > 0 and row[f"{name}_requests"] > 0
            assert f"{name}_errors" not in row
    assert report["concurrency"]["3"]["sequential_p50_latency_s"] > 0
    assert (tmp_path / "b.png").stat().st_size > 10_000
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 80


def test_the_trace_mix_interleaves_every_job_with_other_contents_at_each_level():
    from benchmarks.trace_jobs import JOBS

    four, sixteen = batching.trace_workload(3, seed=4), batching.trace_workload(3, seed=16)
    assert len(four) == 3 * len(JOBS)
    first_round = four[: len(JOBS)]  # one request of every job before the next of any
    assert [r.max_tokens for r in first_round] == [job.max_tokens for job in JOBS]
    assert all(r.temperature == 0 for r in four)
    contents = lambda workload: {r.messages[-1].content for r in workload}  # noqa: E731
    assert len(contents(four) & contents(sixteen)) < len(four) / 4  # jobs with few contents repeat some
    assert contents(four) == contents(batching.trace_workload(3, seed=4))


def test_a_pass_over_the_workload_never_drafts_from_the_pass_before():
    """The closed loop outlasts a pass over its requests: each pass is a cache scope of its own, so a request sent
    again finds none of its earlier answer, while the requests of one pass share a scope; and a later loop (the
    next concurrency level, sending the same requests) shares no scope with an earlier one."""
    from backends.types import GenerationRequest

    requests = [GenerationRequest(prompt=f"request {i}", max_tokens=4) for i in range(3)]
    sent: list[tuple[str, str]] = []

    def complete(request: GenerationRequest) -> int:
        sent.append((request.prompt, request.cache_scope))
        return 1

    loop = batching.closed_loop(complete, requests, clients=1, window_s=0.05)
    assert loop["requests"] == len(sent) > 2 * len(requests)
    assert len(set(sent)) == len(sent), "no request twice in one scope"
    passes = [sent[i : i + 3] for i in range(0, len(sent) - 2, 3)]
    scopes = [{scope for _, scope in one} for one in passes]
    assert all(len(one) == 1 for one in scopes) and len(set.union(*scopes)) == len(passes)
    assert all(scope.endswith(f"/pass-{n}") for n, (scope,) in enumerate(scopes))
    first = {scope for _, scope in sent}
    sent.clear()
    batching.closed_loop(complete, requests, clients=1, window_s=0.01)
    assert first.isdisjoint(scope for _, scope in sent), "a later loop drafts from none of an earlier one's answers"
