"""BENCHMARKS.md from the JSON every benchmark writes: the tables are rendered, never typed, so the document
cannot drift from the run it describes. What no JSON holds (what the published figures mean, and how far they
compare) is the hand-written ``published.md`` beside this module, appended as it is.

Each section renders one benchmark's JSON and is left out, with a line saying so, when that file is missing.
Each also names the weights it was measured on and says so when they are not the shipped ones: a model is
retrained more often than the whole suite (about 50 minutes) is run again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from backends.default_model import DEFAULT_DRAFTERS, DEFAULT_MODEL
from backends.dspark.curves import machine_parts
from backends.loading import resolve_precision
from backends.packed.build import kernels_name
from backends.precision import QUANTIZED_PRECISION, cpu_chip
from benchmarks.trace import redis_line

PUBLISHED = Path(__file__).with_name("published.md")

PAPER_ACCEPTED = {"gsm8k": 6.11, "math500": 5.70, "humaneval": 5.38, "mbpp": 5.13, "mt-bench": 3.64}
"""The DSpark paper's accepted length per round (Qwen3-4B target, gamma 7, temperature 1.0)."""

WORKLOAD_PLOTS = ("latency_vs_rate", "throughput_vs_speed", "speedup_by_group", "predicted_vs_measured", "dspark_share")
Cell = str | float | int | None


def table(headers: Sequence[str], rows: Sequence[Sequence[Cell]], digits: int = 2) -> str:
    """A markdown table; numbers right-aligned and rounded, None as a dash."""

    def cell(value: Cell) -> str:
        if value is None:
            return "-"
        if isinstance(value, int):  # bools too
            return str(value)
        if isinstance(value, float):
            return f"{value:,.{digits}f}"
        return value

    align = ["---" if i == 0 else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _image(results: Path, name: str, base: Path, alt: str) -> str:
    path = results / name
    return f"![{alt}]({os.path.relpath(path, base)})" if path.is_file() else ""


def quality(data: dict, results: Path, base: Path) -> str:
    greedy = data["modes"]["greedy"]
    rows = [
        [kind, k.get("exact"), k.get("json_fields"), k.get("code_parses"), k.get("tool_args"), k.get("distinct_2")]
        for kind, k in greedy["kinds"].items()
    ]
    overall = [(mode, m["overall"]) for mode, m in data["modes"].items()]
    summary = [
        [mode, o["exact_overall"], o["exact_every_kind"], o["json_fields"], o["code_parses"], o["tool_args"]]
        for mode, o in overall
    ]
    return "\n\n".join(
        [
            f"Held-out seed {data['seed']}, {data['per_kind']} subtasks per kind, greedy:",
            table(["kind", "exact", "JSON fields", "code parses", "tool args", "distinct-2"], rows),
            table(["mode", "exact overall", "worst kind", "JSON fields", "code parses", "tool args"], summary),
        ]
    )


def decode(data: dict, results: Path, base: Path) -> str:
    rows = []
    for name, entry in data["sets"].items():
        tps = entry["tokens_per_s"]
        for drafter, d in entry["drafters"].items():
            rows.append(
                [
                    name,
                    drafter,
                    tps["ar"],
                    tps["hf_greedy"],
                    tps.get("hf_prompt_lookup"),
                    tps.get("llama_cpp"),
                    tps.get("llama_cpp_lookup"),
                    d["tokens_per_s"],
                    d["speedup"],
                    d.get("speedup_vs_llama_cpp"),
                    d["mean_accepted"],
                    d.get("mean_verified"),
                    d["lossless_mismatches"],
                ]
            )
    headers = [
        "set",
        "drafter",
        "AR tok/s",
        "HF greedy",
        "HF lookup",
        "llama.cpp",
        "llama.cpp lookup",
        "DSpark tok/s",
        "x AR",
        "x llama.cpp",
        "accepted",
    ]
    peer = (
        "llama.cpp: the same GGUF through llama-cpp-python, same threads and token ids, plain and with its prompt "
        "lookup; HF: transformers on the float32 reference. "
        if data.get("gguf")
        else "No llama.cpp peer in this run. "
    )
    parts = [
        f"{data['prompts']} prompts, at most {data['max_tokens']} tokens, {data['threads']} threads, target served "
        f"as {data['dtype']}; x AR: over this project's own autoregressive decoding of the same model, contenders "
        f"interleaved per prompt. {peer}accepted: tokens committed per round, bonus token included; verified: "
        f"draft tokens verified per round. Greedy DSpark output differed from greedy autoregressive output on "
        f"**{data['lossless_mismatches']}** prompts.",
        table([*headers, "verified", "mismatches"], rows, digits=2),
    ]
    per_forward = peer_tokens_per_forward(data)
    if per_forward:
        parts += [
            "Tokens committed per verifying forward (bonus token included; the peers' counted from their forwards "
            "after the prompt's), prompt lookup's peers beside our copied blocks alone and the best of our variants "
            "by it:",
            table(["set", "HF lookup", "llama.cpp lookup", "our copies", "our best", "best variant"], per_forward),
        ]
    acceptance = [
        [name, drafter, *[round(v, 2) if v is not None else None for v in d["conditional_acceptance"][:7]]]
        for name, entry in data["sets"].items()
        for drafter, d in entry["drafters"].items()
        if d.get("conditional_acceptance")
    ]
    if acceptance:
        parts += [
            "Conditional acceptance by block position (position k given 1..k-1 accepted):",
            table(["set", "drafter", *[f"k={k}" for k in range(1, 8)]], acceptance),
        ]
    costs = data.get("round_costs_ms")
    if costs:
        parts += [
            "Where a published-drafter round's time goes here (ms, median, whole block drafted):",
            table(
                ["part", "ms"], [[name.removesuffix("_ms").replace("_", " "), value] for name, value in costs.items()]
            ),
        ]
    training = data.get("drafter_training")
    if training:
        parts.append(
            f"Published drafter's confidence: held-out ECE of prefix survival {training['ece_before']:.3f} before "
            f"Sequential Temperature Scaling, {training['ece_after']:.3f} after."
        )
    images = [
        _image(results, f"decode/{name}.png", base, alt)
        for name, alt in (
            ("tokens_per_s", "tokens per second by set and drafter"),
            ("acceptance_by_position", "conditional acceptance by block position"),
            ("threshold_sweep", "acceptance rate against a static confidence threshold"),
            ("reliability", "reliability of prefix survival before and after calibration"),
        )
    ]
    return "\n\n".join(parts + [i for i in images if i])


def peer_tokens_per_forward(data: dict) -> list[list[Cell]]:
    """Per set, the prompt-lookup peers' tokens per verifying forward beside ours (empty for a run that predates
    the count)."""
    rows: list[list[Cell]] = []
    for name, entry in data["sets"].items():
        peers = entry.get("peer_tokens_per_forward")
        if not peers:
            continue
        ours = {variant: d["mean_accepted"] for variant, d in entry["drafters"].items() if d["mean_accepted"]}
        best = max(ours, key=ours.get) if ours else None
        copies = ours.get("lookup")
        rows.append([name, peers.get("hf_prompt_lookup"), peers.get("llama_cpp_lookup"), copies, ours.get(best), best])
    return rows


def engine(data: dict, results: Path, base: Path) -> str:
    """A forward's cost by tokens in it, per engine, beside the weight-read floor; where a step's time goes."""
    tokens = list(data["engines"]["packed"]["forward_ms"]) if "packed" in data["engines"] else []
    rows = [
        [name, *[e["forward_ms"][n] for n in tokens], e["verify4_steps"], e["verify8_steps"]]
        for name, e in data["engines"].items()
    ]
    parts = [
        f"{data['cpu']}, {data['threads']} threads, after a context of {data['context']} tokens; median ms of a "
        f"forward of n new tokens through the batch object the decode engine drives, every layer's states kept.",
        table(["engine", *[f"{n} tok" for n in tokens], "verify 4 / step", "verify 8 / step"], rows),
    ]
    packed = data["engines"].get("packed")
    if packed:
        b = packed["breakdown"]
        parts.append(
            f"Weight-read floor: {packed['read_floor_ms']:.2f} ms to read the {packed['weight_bytes'] / 1e6:.0f} MB "
            f"a packed forward reads (a sum over a buffer that size, same run); one step is "
            f"**{packed['step_over_floor']:.2f}x** it. A step's parts ({packed['kernels']} kernels): the layers' "
            f"weight matrices alone {b['layer_weights_ms']:.2f} ms, the LM head {b['lm_head_ms']:.2f} ms, the whole "
            f"kernel call {b['kernel_call_ms']:.2f} ms (attention, norms and the rest are the difference), the Python "
            f"around it the rest of the 1-token column."
        )
        if "prefill_tokens_per_s" in packed:
            targets = packed["targets"]
            parts.append(
                f"Against the targets: a step {packed['step_over_floor']:.2f}x the floor (target "
                f"{targets['step_over_floor']}x), the kernel call {packed['kernel_over_weights']:.2f}x the weight "
                f"matrices' time (target {targets['kernel_over_weights']}x; measured one matrix at a time, so an "
                f"L3 that holds one reads it faster than a step does), prefill "
                + ", ".join(f"{s:,.0f}" for s in packed["prefill_tokens_per_s"].values())
                + f" prompt tokens/s at {', '.join(packed['prefill_tokens_per_s'])} tokens (target "
                f"{targets['prefill_tokens_per_s']:,.0f}), on {packed['threads']} threads of the engine's own."
            )
        by_context = packed.get("step_by_context")
        if by_context:
            parts.append(
                "A one-token step and a verifying pass of 8 tokens by the context before them, beside the keys and "
                "values one token's attention reads:"
            )
            parts.append(
                table(
                    ["context", "step ms", "pass of 8 ms", "pass / step", "cache MB read", "step / floor"],
                    [
                        [
                            f"{int(n):,}",
                            c["step_ms"],
                            c["verify8_ms"],
                            c["verify8_ms"] / c["step_ms"],
                            c["cache_mb"],
                            c["step_ms"] / packed["read_floor_ms"],
                        ]
                        for n, c in by_context.items()
                    ],
                )
            )
    parts.append(_image(results, "engine.png", base, "forward cost by tokens in it"))
    if "host" in data:
        parts.append(_noisy_host(data["host"]))
    return "\n\n".join(p for p in parts if p)


def _noisy_host(host: dict) -> str:
    """The engine's decoding speed after the host process's own work, against a clean process."""
    work = [w for w in next(iter(host["tokens_per_s"].values())) if w != "clean"]
    rows = [
        [path, speeds["clean"], *[f"{speeds[w]:.0f} ({host['after_work_ratio'][path][w]:.2f}x)" for w in work]]
        for path, speeds in host["tokens_per_s"].items()
    ]
    skipped = f" ({', '.join(host['skipped'])} not installed)" if host["skipped"] else ""
    return "\n\n".join(
        [
            f"**A noisy host.** Greedy tokens/s of the standard pool ({host['requests']} requests of "
            f"{host['max_tokens']} tokens, median of {host['repeats']} fresh processes each), in a clean process and "
            f"after the host process's main thread ran other work first{skipped}: in-process through the SDK, through "
            f"the gateway over loopback HTTP, and on a Redis worker. Target: at least "
            f"{host['targets']['after_work_ratio']}x of clean everywhere.",
            table(["path", "clean", *[f"after {w}" for w in work]], rows, digits=0),
            f"Idle, the process took {100 * host['idle_core_share']:.2f}% of a core over 10 s (target under "
            f"{100 * host['targets']['idle_core_share']:g}%); `dspark-router --help` answered in "
            f"{host['help_s']:.2f} s (target {host['targets']['help_s']}) and `dspark-router route MESSAGE` in "
            f"{host['route_s']:.2f} s (target {host['targets']['route_s']}), models not loaded.",
        ]
    )


def copies(data: dict, results: Path, base: Path) -> str:
    """Copied blocks replayed on greedy corpus answers: acceptance by match, and each stored curve's outcome."""
    by_match = data["acceptance_by_match"]
    block = data["block"]
    match_rows = [[f"{bound}+", entry["copies"], *entry["conditional_acceptance"]] for bound, entry in by_match.items()]
    rules = ("copies", "copies_whole", "prompt_lookup")
    machine_rows = [
        [
            f"{machine_name(key)}, {machine_parts(key)[3].replace('=', ' ')}",
            *[rules_[rule]["tokens_per_forward"] for rule in rules],
            *[rules_[rule]["speedup"] for rule in rules],
            rules_["copies"]["mean_verified"],
        ]
        for key, rules_ in data["machines"].items()
    ]
    return "\n\n".join(
        [
            f"{data['answers']} greedy corpus answers ({data['answer_tokens']:,} tokens; training text, not the "
            "evaluation prompts), replayed without the model: a greedy answer fixes what each copy keeps. Every copy "
            f"verified whole ({block} tokens at most), by the length of its match (tokens, the anchor included) and "
            "position, conditional acceptance:",
            table(["match", "copies", *[f"k={k + 1}" for k in range(block)]], match_rows),
            "Each stored cost curve's outcome: tokens per verifying forward (bonus included) and speed over plain "
            "decoding, each forward timed by the curve, for the decode loop's rule (`copies`: `CopyAcceptance` and "
            "Algorithm 1), the same copies verified whole, and transformers' prompt lookup (the earliest match of "
            "the newest 2 tokens, 10 verified every round):",
            table(
                [
                    "curve",
                    "copies / fwd",
                    "whole / fwd",
                    "lookup / fwd",
                    "copies x",
                    "whole x",
                    "lookup x",
                    "copies verified",
                ],
                machine_rows,
            ),
            _image(results, "copies/copies.png", base, "copies against prompt lookup on every stored curve"),
        ]
    )


def structured(data: dict, results: Path, base: Path) -> str:
    backends = data["backends"]
    names = list(backends)
    keys = ("valid", "invalid", "truncated", "forced_token_share", "constraint_us_per_token", "greedy_tokens_per_s")
    rows = [[key.replace("_", " "), *[backends[n][key] for n in names]] for key in keys]
    return "\n\n".join(
        [
            f"{data['schemas']} schemas: {data['compiled']} compiled ({data['compiled_share']:.1%}), "
            f"{data['refused']} refused with a typed error, {data['prompt_too_long']} prompts too long; one "
            f"instance per schema greedy and at 0.8, at most {data['max_tokens']} tokens. DSpark speedup with "
            f"constraints on: {data.get('dspark_speedup_constrained', 0):.2f}x.",
            table(["", *names], rows),
        ]
    )


MIXES = {
    "held-out": "held-out subtasks and shared prompts",
    "trace": "an agent's templated traffic: bench trace's jobs interleaved, other contents at each level",
}


def batching(data: dict, results: Path, base: Path, figure: str = "batching.png") -> str:
    """``bench batching`` on one mix: each contender it ran, by concurrency (the trace mix runs two of them);
    ``figure``: its plot, as the suite step that ran it names it."""
    names = {
        "batched": "batched",
        "sequential": "one at a time",
        "dspark_scheduled": "DSpark scheduled",
        "dspark_fixed": "DSpark fixed",
        "transformers_serve": "transformers serve",
    }
    ran = [name for name in names if any(f"{name}_tokens_per_s" in entry for entry in data["concurrency"].values())]
    paired = {"batched", "dspark_scheduled"} <= set(ran)
    rows = []
    for level, entry in data["concurrency"].items():
        row: list[Cell] = [level]
        for name in ran:
            total, each = entry.get(f"{name}_tokens_per_s"), entry.get(f"{name}_per_request_tokens_per_s")
            row.append(None if total is None else f"{total:,.0f} ({each:,.0f})")
        if paired:
            row.append(entry["dspark_scheduled_tokens_per_s"] / entry["batched_tokens_per_s"])
        row.append(entry.get("dspark_scheduled_mean_verify_budget"))
        rows.append(row)
    headers = ["C", *(names[name] for name in ran), *(["DSpark over batched"] if paired else []), "budget"]
    mix = data.get("mix", "held-out")
    return "\n\n".join(
        [
            f"Closed loop of C clients, {data['window_s']:g} s per contender and level, {data['workload']} "
            f"requests ({MIXES[mix]}), greedy, at most {data['max_tokens']} tokens, "
            f"{data['threads']} threads, drafter `{data['drafter']}`. Total tokens/s (per-request tokens/s); "
            "budget: mean draft tokens verified per request and round, scheduled.",
            table(headers, rows),
            _image(results, figure, base, "throughput against per-request speed"),
        ]
    )


def route(data: dict, results: Path, base: Path) -> str:
    cv = data["cross_validation"]
    rows = [
        [
            "test split",
            data["auroc"],
            data.get("auroc_faster"),
            data["oracle_gain_ratio"],
            data["all_dspark_gain_ratio"],
            data["p50_us"],
            data["p99_us"],
        ],
        [
            f"{cv['folds']} folds by template",
            cv["auroc_mean"],
            cv.get("auroc_faster_mean"),
            cv["oracle_gain_ratio_mean"],
            cv["all_dspark_gain_ratio_mean"],
            None,
            None,
        ],
    ]
    parts = [
        f"{data['subtasks']} held-out subtasks; label: measured speedup >= {data['margin']} (AUROC faster: > 1); "
        f"routed at the calibrated threshold {data['threshold']:.2f}.",
        table(["", "AUROC", "AUROC faster", "oracle gain", "all-DSpark gain", "scoring p50 µs", "p99 µs"], rows),
    ]
    if "by_kind" in cv:
        columns = ("subtasks", "sent_to_dspark", "dspark_faster", "median_speedup", "median_predicted")
        columns += ("oracle_saved_s", "saved_s", "missed_s", "lost_s")
        kinds = [[kind, *(r[column] for column in columns)] for kind, r in cv["by_kind"].items()]
        headers = ["kind", "n", "to DSpark", "DSpark faster", "median x", "predicted x"]
        headers += ["oracle saves s", "saved s", "missed s", "lost s"]
        parts += [
            f"Where routing gains and loses over the {cv['folds']} template folds (each subtask scored by a "
            "classifier that never saw its template); the expected-gain model's log correlation with the "
            f"measured speedups out of fold: {cv['gain_log_correlation']:.2f}.",
            table(headers, kinds),
        ]
    if ceiling := data.get("noise_ceiling"):
        parts.append(
            f"Noise ceiling: {ceiling['pairs']} of the subtasks measured a second time (`calibrate --sample`): their "
            f"log speedups correlate {ceiling['log_correlation']:.2f} between the two runs (greedy "
            f"{ceiling['greedy_log_correlation']:.2f}, sampled {ceiling['sampled_log_correlation']:.2f}), the label "
            f"'DSpark faster' agrees {ceiling['faster_label_agreement']:.0%} of the time (AUROC of the first speedup "
            f"on the second's label {ceiling['remembered_auroc_faster']:.2f}), and routing each by its own "
            f"first measurement saves {ceiling['remembered_oracle_gain_ratio']:.2f} of the second run's oracle "
            f"(all-DSpark {ceiling['all_dspark_gain_ratio']:.2f}): no router that learns from one measurement per "
            "subtask can be scored much above that."
        )
    if carried := data.get("carry_over"):
        parts.append(
            f"Carried to another machine: the same {carried['pairs']} subtasks measured on "
            f"{machine_name(carried['remeasured_on'])} against the labels' {machine_name(carried['measured_on'])}. "
            f"The two machines' cost curves scale a speedup by {carried['carry_factor']:.2f}; measured there, log "
            f"speedups are off the labels by {carried['mean_log_ratio_measured']:+.2f} on average and off the "
            f"carried labels by {carried['mean_log_ratio_carried']:+.2f} (correlation "
            f"{carried['log_correlation']:.2f}). DSpark is faster there on {carried['dspark_faster_share']:.0%}; "
            f"'faster' carried over agrees {carried['faster_label_agreement_carried']:.0%} (as measured: "
            f"{carried['faster_label_agreement_measured']:.0%}), and routing there by the carried labels saves "
            f"{carried['carried_oracle_gain_ratio']:.2f} of that machine's oracle (by the labels as measured "
            f"{carried['measured_oracle_gain_ratio']:.2f}, all-DSpark {carried['all_dspark_gain_ratio']:.2f})."
        )
    parts += [_replayed(data[name], what) for name, what in REPLAYS if data.get(name)]
    return "\n\n".join([*parts, _image(results, "route.png", base, "ROC and score against measured speedup")])


REPLAYS = (
    ("online", "the test split's templates"),
    ("new_mix", "hand-written agent requests the corpus generator never wrote"),
)


def _replayed(replay: dict, what: str) -> str:
    """One sentence on routing while retraining from a shadow log (:mod:`benchmarks.route_online`)."""

    def ratio(name: str) -> str:
        value = replay.get(name)
        return "n/a" if value is None else f"{value:.3f}"

    machine = replay.get("machine")
    measured = f", measured on {machine_name(machine)}" if machine else ""
    carried = f" (its {replay['carried']} speedups carried there by the cost curves)" if replay.get("carried") else ""
    if "dspark_faster_share" in replay:
        measured += (
            f", where DSpark is faster on {replay['dspark_faster_share']:.0%} of them (median speedup "
            f"{replay['median_speedup']:.2f}x; the corpus carried there: {replay['corpus_dspark_faster_share']:.0%}, "
            f"{replay['corpus_median_speedup']:.2f}x)"
        )
    return (
        f"Learning from live traffic, {what}: {replay['subtasks']} requests{measured}, replayed in "
        f"{len(replay['orders'])} seeded orders. {replay['shadow']:.0%} of them are measured on both pools and "
        f"logged, and the classifier, fitted on the corpus{carried}, is retrained every {replay['batch']} "
        "requests; each request is routed by the classifier of before it arrived. Time taken over the oracle's "
        f"(each request on the pool it was sent to): retrained {ratio('time_over_oracle_mean')} (second half "
        f"{ratio('second_half_time_over_oracle_mean')}), static {ratio('static_time_over_oracle')} (second half "
        f"{ratio('static_second_half_time_over_oracle_mean')}), all-DSpark {ratio('all_dspark_time_over_oracle')}, "
        f"all-standard {ratio('all_standard_time_over_oracle')}. Share of the oracle's saving: retrained "
        f"{ratio('oracle_gain_ratio_mean')}, static {ratio('static_oracle_gain_ratio')}, all-DSpark "
        f"{ratio('all_dspark_gain_ratio')}."
    )


def machine_name(key: str) -> str:
    """A machine key (``cpu:NAME|torch.DTYPE|threads=N``) as words: 'NAME in DTYPE'."""
    _, chip, precision, _ = machine_parts(key)
    return f"{chip} in {precision.removeprefix('torch.')}"


def workload(data: dict, results: Path, base: Path) -> str:
    rows = []
    for rate in data["rates"]:
        for policy in data["policies"]:
            r = data["results"][policy][rate]
            rows.append(
                [
                    rate,
                    policy,
                    r.get("requests_per_s"),
                    r.get("tokens_per_s"),
                    r.get("mean_latency_s"),
                    r.get("p50_latency_s"),
                    r.get("p95_latency_s"),
                    r.get("p99_latency_s"),
                    r.get("dspark_share"),
                    r.get("greedy_mismatches"),
                ]
            )
    headers = ["rate", "policy", "req/s", "tok/s", "mean s", "p50 s", "p95 s", "p99 s", "to DSpark", "mismatch"]
    w = data["workload"]
    images = [
        _image(results, f"workload/{name}.png", base, name.replace("_", " "))
        for name in (
            "latency_vs_rate",
            "throughput_vs_speed",
            "speedup_by_group",
            "predicted_vs_measured",
            "dspark_share",
        )
    ]
    parts = [
        f"{w['requests']} requests ({w['subtasks']} held-out subtasks, {w['prompts']} shared prompts), "
        f"Poisson arrivals at multiples {', '.join(f'{m:g}' for m in data['rate_multiples'])} of one worker's "
        f"capacity ({data['single_worker_requests_per_s']:.2f} req/s); rate in requests per second. "
        + _capacity(data.get("capacity")),
        table(headers, rows),
        _comparison(data["comparison"]),
        _solo_routing(data.get("solo_routing")),
        *images,
    ]
    return "\n\n".join(part for part in parts if part)


def _capacity(capacities: dict | None) -> str:
    if not capacities:
        return ""
    shapes = {(c["workers"], c["slots"]) for c in capacities.values()}
    if len(shapes) > 1:
        return "Capacity differs between policies: " + ", ".join(
            f"{policy} {c['workers']} workers, {c['slots']} slots" for policy, c in capacities.items()
        )
    workers, slots = shapes.pop()
    return (
        f"Every policy has the same capacity: {workers} in-process workers of one torch thread each, {slots} batch "
        "slots in all (the routed policies one DSpark and one standard worker, the single-pool ones both of one "
        "kind)."
    )


def _solo_routing(solo: dict | None) -> str:
    """Each request alone: what routing by the expected-gain model costs against an oracle, per source."""
    if not solo:
        return ""
    columns = ("requests", "standard_s", "dspark_s", "routed_s", "oracle_s", "routed_over_oracle")
    rows = [[source, *(row[column] for column in columns)] for source, row in solo.items()]
    return "Each request alone, summed (routed: to DSpark where the expected-gain model predicts a gain):\n\n" + table(
        ["source", "requests", "standard s", "DSpark s", "routed s", "oracle s", "routed / oracle"], rows
    )


def _comparison(comparison: dict) -> str:
    savings = ("saving_s", "oracle_saving_s", "oracle_saving_ratio")
    rows = [
        [rate, e["better_single_pool"], "yes" if e["beats_single_pools"] else "no", *(e.get(k) for k in savings)]
        for rate, e in comparison["by_rate"].items()
    ]
    headers = ["rate", "better single pool", "time_saved beats both", "its saving s", "oracle's s", "share"]
    return table(headers, rows)


def fleet(data: dict, results: Path, base: Path) -> str:
    """The simulated fleet: a row per load and policy, the targets per load, the reality check, the plots."""
    comparison = data["comparison"]["by_load"]
    rows = []
    for load in data["loads"]:
        for policy in data["policies"]:
            r = data["results"][policy][load]
            share = comparison.get(load, {}).get(f"{policy}_oracle_share")
            rows.append(
                [
                    load,
                    policy,
                    r["subtasks_per_s"],
                    r["mean_latency_s"],
                    r["p95_latency_s"],
                    r["p99_latency_s"],
                    r["run_mean_latency_s"],
                    r["dspark_share"],
                    share,
                ]
            )
    headers = ["load", "policy", "subtasks/s", "mean s", "p95 s", "p99 s", "run mean s", "to DSpark", "oracle share"]
    targets = [
        [
            load,
            e["better_single_pool"],
            "yes" if e["past_saturation"] else "no",
            "yes" if e["meets_latency_target"] else "no",
            e.get("time_saved_over_oracle"),
        ]
        for load, e in comparison.items()
    ]
    fleet_, trace, profile, timing = data["fleet"], data["trace"], data["profile"], data["timing"]
    routed = " and ".join(f"{count:,} {name}" for name, count in fleet_["routed"].items())
    parts = [
        f"{fleet_['workers']:,} simulated workers of `{profile['name']}` ({profile['description']}), batches of "
        f"{profile['max_batch']}; the routed policies on {routed} workers. {trace['subtasks']:,} subtasks per policy "
        f"and load in {trace['runs']:,} {trace['kind']}, each a held-out calibration record of its kind. Load: "
        f"offered subtasks per second over the all-standard fleet's capacity ({data['capacity_subtasks_per_s']:,.0f}"
        f"/s). The policy judged: {data['judged']['config']}, {'with' if data['judged']['rules'] else 'without'} its "
        f"rules. Oracle share: the time saved against all-standard over the oracle's. {timing['subtasks']:,} "
        f"subtasks simulated in {timing['wall_s']:.0f} s on one core ({timing['us_per_subtask']:.0f} µs each).",
        table(headers, rows),
        table(
            ["load", "better single pool", "past saturation", "time_saved meets latency", "its mean / oracle's"],
            targets,
        ),
        _fleet_reality(data.get("reality")),
        *(
            _image(results, f"fleet/{name}.png", base, name.replace("_", " "))
            for name in ("latency_vs_rate", "throughput_vs_rate", "oracle_share", "reality")
        ),
    ]
    return "\n\n".join(part for part in parts if part)


def _fleet_reality(reality: dict | None) -> str:
    if not reality:
        return ""
    columns = ("measured_mean_s", "simulated_mean_s", "mean_error", "measured_p95_s", "simulated_p95_s", "p95_error")
    rows = [[row["rate"], row["policy"], *(row[column] for column in columns)] for row in reality["rows"]]
    headers = ["rate/s", "policy", "measured mean s", "simulated", "error", "measured p95 s", "simulated", "error"]
    return (
        f"Against `bench workload` at its own scale ({reality['workers']} workers, the same requests and arrival "
        f"schedules); target: simulated means within {reality['target']:.0%}, worst "
        f"{reality['worst_mean_error']:.0%}:\n\n" + table(headers, rows)
    )


def pools(data: dict, results: Path, base: Path) -> str:
    rows = [
        [
            name,
            c["requests_per_s"],
            c["tokens_per_s"],
            c["p50_latency_ms"],
            c["p95_latency_ms"],
            data["sequential"][name]["p50_latency_ms"],
            data["sequential"][name]["ttft_p50_ms"],
        ]
        for name, c in data["concurrent"].items()
    ]
    hop = data.get("redis_hop", {})
    return "\n\n".join(
        [
            f"{data['requests']} held-out greedy subtasks, closed loop of {data['concurrency']} clients, median of "
            f"{data['rounds']} rounds. The Redis hop, one request at a time (median over requests of the difference on "
            f"the same request): {hop.get('per_request_ms', 0):+.1f} ms per request, {hop.get('ttft_ms', 0):+.1f} ms "
            "to the first token.",
            table(["contender", "req/s", "tok/s", "p50 ms", "p95 ms", "sequential p50 ms", "TTFT p50 ms"], rows),
            _image(results, "pools.png", base, "throughput and latency per contender"),
        ]
    )


def gateway(data: dict, results: Path, base: Path) -> str:
    rows = [
        [name, data[key]["in_process"]["p50_ms"], data[key]["gateway"]["p50_ms"], data[key]["added_p50_ms"]]
        for name, key in (("short completion", "completion"), ("/v1/route", "route"), ("first token (SSE)", "ttft"))
    ]
    load = data["route_throughput"]
    return "\n\n".join(
        [
            table(["ms, p50", "in-process", "gateway", "added"], rows),
            f"`/v1/route` under {load['clients']} keep-alive clients: {load['requests_per_s']:,.0f} requests/s, "
            f"p99 {load['p99_ms']:.0f} ms, {load['non_200']} errors.",
        ]
    )


def soak(data: dict, results: Path, base: Path) -> str:
    """The soak's figures (it is not part of ``bench all``: it runs as long as asked, so it names its command)."""
    minutes = data["seconds"] / 60
    command = f"`dspark-router bench soak --minutes {minutes:g} --json {os.path.relpath(results, base)}/soak.json`"
    faults = ", ".join(f"{f['fault']} at {f['at_s'] / 60:.1f} min" for f in data["faults"])
    errors = ", ".join(f"{status} x{n}" for status, n in sorted(data["errors_by_status"].items())) or "none"
    met, targets = data["met"], data["targets"]
    rows = [
        ["requests lost", data["lost"], "0", met["lost"]],
        ["requests duplicated", data["duplicated"], "0", met["duplicated"]],
        ["5xx other than typed 503s", data["server_errors"], "0", met["server_errors"]],
        [
            f"p99, last {data['p99_window_s'] / 60:g} min against the first",
            f"{data['p99_last_ms']:.0f} ms / {data['p99_first_ms']:.0f} ms ({100 * data['p99_drift']:+.1f}%)",
            f"within {100 * targets['p99_drift']:.0f}%",
            met["p99_drift"],
        ],
    ]
    after = f"RSS growth after {data['rss_growth_after_s'] / 60:g} min"
    rows += [
        [
            f"{after}: {label}",
            f"{100 * growth:+.1f}%",
            f"< {100 * targets['rss_growth']:.0f}%",
            growth < targets["rss_growth"],
        ]
        for label, growth in sorted(data["rss_growth"].items())
    ]
    return "\n\n".join(
        [
            f"{command} ({data['model']}, {data['cpus']} cores)",
            f"Capacity {data['capacity_rps']:.1f} requests/s in a closed loop; driven open loop at "
            f"{data['rate_rps']:.1f} requests/s ({100 * data['load']:.0f}%) for {minutes:g} minutes: "
            f"{data['requests']:,} requests; faults: {faults}; answers other than 200: {errors}.",
            table(["", "measured", "target", "met"], [[*r[:3], "yes" if r[3] else "no"] for r in rows]),
            _image(results, "soak.png", base, "latency and RSS over the soak"),
        ]
    )


def published(data: dict | None, results: Path, base: Path) -> str:
    """Our accepted lengths on the paper's sets beside its figures, then the hand-written comparison."""
    parts = []
    if data is not None:
        rows = []
        for name, paper in PAPER_ACCEPTED.items():
            ours = data["sets"].get(f"{name}_t1", {}).get("drafters", {})
            rows.append([name, paper, *[ours.get(d, {}).get("mean_accepted") for d in ("dspark", "heads")]])
        parts.append(
            table(["set (temperature 1)", "paper: DSpark, Qwen3-4B", "ours: dspark drafter", "ours: span heads"], rows)
        )
    parts.append(PUBLISHED.read_text().strip())
    return "\n\n".join(parts)


def trace(data: dict, results: Path, base: Path, figure: str = "trace.png") -> str:
    """The agent trace by job, early and late in a job, beside transformers' prompt lookup; the cache's costs.
    ``figure``: its plot, as the suite step that ran it names it."""
    s, warm, targets = data["summary"], data["warm"], data["targets"]
    lookup = data.get("prompt_lookup_tokens_per_forward", {})
    rows = [
        [
            name,
            job["early"]["tokens_per_forward"],
            job["early"]["speedup"],
            job["late"]["tokens_per_forward"],
            job["late"]["dspark_tokens_per_s"],
            job["late"]["standard_tokens_per_s"],
            job["late"]["speedup"],
            lookup.get(name),
        ]
        for name, job in s["jobs"].items()
    ]
    cache = data["cache"]
    return "\n\n".join(
        [
            f"{data['cpu']}. {data['requests_per_job']} greedy requests of each job, through the gateway, the DSpark "
            f"pool (drafting from its earlier answers) and the standard pool interleaved; a job's first {warm} "
            f"requests apart from the rest. Tokens a forward count every completion token (those a grammar forced "
            f"too) over the target's forwards. Prompt lookup: transformers' (10 tokens a round) on the float32 "
            f"reference, on each job's first late requests, tokens a forward only.",
            table(
                [
                    "job",
                    f"first {warm}: tok/fwd",
                    "speedup",
                    "later: tok/fwd",
                    "DSpark tok/s",
                    "standard tok/s",
                    "speedup",
                    "prompt lookup tok/fwd",
                ],
                rows,
            ),
            f"Over jobs, from request {warm + 1} on: **{s['late_tokens_per_forward']:.2f} tokens a forward, "
            f"{s['late_speedup']:.2f}x the standard pool** (targets {targets['late_tokens_per_forward']} and "
            f"{targets['late_speedup']}x; at least {targets['job_tokens_per_forward']} and {targets['job_speedup']}x "
            f"on every job); the first {warm} of every job {'never' if s['early_never_slower'] else 'sometimes'} "
            f"slower than the standard pool; greedy mismatches: {s['greedy_mismatches']}. The cache after the trace: "
            f"{cache['answers']} answers, {cache['tokens']:,} tokens, {cache['memory_mb']:.2f} MB; inserting a token "
            f"{cache['insert_us_per_token']:.1f} us, a draft {cache['speculate_us']:.0f} us (Python).",
            *([_routed_trace(data["auto"])] if "auto" in data else []),
            *([_llama_lookup_trace(data)] if "llama_lookup" in data else []),
            *([redis_line(data["redis_workers"]).capitalize() + "."] if "redis_workers" in data else []),
            _image(results, figure, base, "the agent trace by position within a job"),
        ]
    )


def _routed_trace(auto: dict) -> str:
    share = "-" if auto["oracle_share"] is None else f"{auto['oracle_share']:.0%}"
    return (
        f"Through `dspark-router/auto` (the router's own choice, the template's measured speedup included; a replay of "
        f"its own from fresh caches): **{auto['auto_s']:.1f} s** for the trace, "
        f"{sum(auto['auto_to_dspark'].values())} of {auto['requests']} requests to DSpark, against "
        f"{auto['all_dspark_s']:.1f} s all-DSpark and {auto['all_standard_s']:.1f} s all-standard in the paired "
        f"replay, and {auto['oracle_s']:.1f} s for the oracle that sends each request to the pool that answered it "
        f"faster there ({share} of the oracle's saving over all-standard; the two replays' own noise included)."
    )


def _llama_lookup_trace(data: dict) -> str:
    """llama.cpp's lookup decoding on the same trace, beside ours: tokens a forward and speed over plain decoding,
    each in its own engine."""
    peer, warm = data["llama_lookup"], data["warm"]
    rows = [
        [
            name,
            job["late"]["tokens_per_forward"],
            job["late"]["speedup"],
            peer["jobs"][name]["early_tokens_per_forward"],
            peer["jobs"][name]["late_tokens_per_forward"],
            peer["jobs"][name]["plain_tokens_per_s"],
            peer["jobs"][name]["late_tokens_per_s"],
            peer["jobs"][name]["late_speedup"],
        ]
        for name, job in data["summary"]["jobs"].items()
        if name in peer["jobs"]
    ]
    return "\n\n".join(
        [
            "llama.cpp's lookup decoding on the same requests (`llama-lookup`, built by `make llama-lookup` from the "
            "pinned llama-cpp-python source with the Makefile's flags): on the same GGUF and threads, greedy, the "
            "same chat-templated prompt and JSON schema, drafting from n-grams of the prompt, its output and one "
            "dynamic cache file a job's requests share (llama.cpp's way of drafting from the traffic). Its speed is "
            "its decoding loop's, against the same binary drafting nothing (plain llama.cpp) on the late requests; "
            "ours is the DSpark pool's over the standard pool's, through the gateway, prompts included.",
            table(
                [
                    "job",
                    "DSpark later: tok/fwd",
                    "over standard",
                    f"llama-lookup first {warm}: tok/fwd",
                    "later: tok/fwd",
                    "llama.cpp plain tok/s",
                    "llama-lookup tok/s",
                    "over plain",
                ],
                rows,
            ),
            f"Over jobs, from request {warm + 1} on: llama-lookup {peer['late_tokens_per_forward']:.2f} tokens a "
            f"forward, {peer['late_speedup']:.2f}x plain llama.cpp"
            + ("" if peer["prompts_read_alike"] else " (some prompts tokenized to other ids there)")
            + ".",
        ]
    )


Section = tuple[str, str, Callable[[dict, Path, Path], str]]
SECTIONS: tuple[Section, ...] = (
    ("engine", "The engine's forward", engine),
    ("quality", "Answer quality", quality),
    ("decode", "Decoding speed", decode),
    ("copies", "Copied blocks on every stored curve", copies),
    ("structured", "Structured output", structured),
    ("batching", "Batching", batching),
    ("batching-trace", "Batching an agent's templated traffic", partial(batching, figure="batching-trace.png")),
    ("route", "Routing quality", route),
    ("workload", "The agent workload", workload),
    ("fleet", "A simulated fleet", fleet),
    ("pools", "Redis worker pools", pools),
    ("gateway", "The REST gateway", gateway),
    ("trace", "An agent's trace: drafting from the traffic", trace),
    ("trace-redis", "The same trace on two Redis workers", partial(trace, figure="trace-redis.png")),
)


def machine() -> str:
    cpu = cpu_chip()
    precision = resolve_precision("auto", torch.device("cpu"), DEFAULT_MODEL)
    served = (
        f"its GGUF's blocks (the packed engine, {kernels_name()} kernels)"
        if precision == QUANTIZED_PRECISION
        else str(precision)
    )
    return (
        f"{cpu}, {os.cpu_count()} cores, the default model served from {served.removeprefix('torch.')}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, {platform.system()} {platform.release()}"
    )


def weights_id(folder: Path = DEFAULT_DRAFTERS) -> str | None:
    """The start of the SHA-256 of the drafters' weights (the target is fixed by its GGUF's checksum): which
    drafters a benchmark measured."""
    files = sorted(folder.rglob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def _ran(run: dict[str, Any], name: str, shipped: str | None) -> list[str]:
    """The command a section's numbers came from, how long it took, and on which weights."""
    if not run.get("command"):
        return []
    details = [f"{run['seconds'] / 60:.1f} min", run["finished"]] if run.get("finished") else []
    details += [f"weights `{run['weights']}`"] if run.get("weights") else []
    lines = [f"`{run['command']}`" + (f" ({', '.join(details)})" if details else ""), ""]
    lines += [f"Machine: {run['machine']}.", ""] if run.get("machine") else []
    if run.get("weights") and shipped and run["weights"] != shipped:
        lines += [
            f"**Measured on earlier weights than the shipped ones (`{shipped}`)**: "
            f"`dspark-router bench all --only {name}` measures this section again.",
            "",
        ]
    return lines


def render(results: Path, runs: dict[str, Any], base: Path) -> str:
    """The whole document; ``runs`` is what ``bench all`` recorded (the machine, and each benchmark's command
    and time), so the same results always render the same text."""
    loaded = {name: _load(results / f"{name}.json") for name, _, _ in SECTIONS}
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`dspark-router bench all`) from the JSON in "
        f"[`{os.path.relpath(results, base)}`]({os.path.relpath(results, base)}); every table below is rendered "
        "from it. Speedups are ratios of contenders measured side by side in one run, interleaved.",
        "",
        "Each section names the machine it ran on and what served the model: machines and engines differ in what "
        "a forward of several tokens costs against one (on the packed engine a verifying pass of 8 tokens costs "
        "1.9-2.5 single steps on a Zen 4 EPYC, 1.5 on a Zen 5 and 2.7 on a Xeon whose L3 holds the weights, and 1.1 "
        "in bfloat16 on transformers, whose single step is 11 times slower), and that ratio decides what speculative "
        "decoding can gain.",
        "",
    ]
    shipped = weights_id()
    for name, title, render_section in SECTIONS:
        lines += [f"## {title}", "", *_ran(runs.get("benchmarks", {}).get(name, {}), name, shipped)]
        data = loaded[name]
        lines += [render_section(data, results, base) if data is not None else f"No `{name}.json` in this run.", ""]
    soaked = _load(results / "soak.json")
    if soaked is not None:
        lines += ["## An hour of the gateway", "", soak(soaked, results, base), ""]
    lines += ["## Against published figures", "", published(loaded["decode"], results, base), ""]
    return "\n".join(lines)


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None
