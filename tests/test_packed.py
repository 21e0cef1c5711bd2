"""The packed engine on the default model as it is served (its GGUF's own Q4_1 and Q8_0 blocks): a token's logits
do not depend on what shares its forward, so greedy DSpark is greedy plain decoding token for token, a request
decodes the same alone or in a busy batch, both instruction sets give the same bits, and pools share one copy."""

from __future__ import annotations

import copy

import pytest
import torch

from backends.autoregressive import AutoregressiveBackend
from backends.default_model import DEFAULT_MODEL
from backends.dspark.backend import DSparkBackend
from backends.loading import load_model, load_shared
from backends.packed.build import kernels, kernels_name
from backends.packed.kv import PackedKV
from backends.packed.linear import PackedLinear
from backends.packed.model import PackedLlama
from backends.precision import QUANTIZED_PRECISION
from backends.training import features as feature_cache
from backends.training.distill import Distilled
from backends.training.features import FeatureCache, build_feature_cache
from backends.types import GenerationRequest
from tests.test_batching import complete_together

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    'Extract the name and age as JSON: "Maria is 34 and lives in Lisbon."',
    "Summarise in one sentence: the meeting moved to Tuesday because the room was booked.",
]
LONG_PROMPT = " ".join(PROMPTS * 8)
"""A request past three of attention's splits (``ATTENTION_SPLIT`` positions each), whose heads are combined."""


@pytest.fixture(scope="module")
def served():
    return load_shared(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def backends(served):
    return AutoregressiveBackend(served), DSparkBackend.from_pretrained(DEFAULT_MODEL, drafter="dspark")


def _ids(served, text: str) -> list[int]:
    return served.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_the_default_model_is_served_from_its_blocks(served):
    assert served.precision == QUANTIZED_PRECISION and served.packed.weight_bytes < 100e6
    assert served.packed.engine.kernels == kernels_name()  # what the cost curve's machine key says


@pytest.mark.parametrize("text", [PROMPTS[0], LONG_PROMPT], ids=["short", "long"])
def test_a_tokens_logits_do_not_depend_on_what_shares_its_forward(served, text):
    """The last prompt token: in the prompt's own forward, alone after the rest, and in one forward with 15 other
    requests' tokens (rows of 1 to 8 tokens at other positions). Once after a short prompt, and once after a long
    one, past three of attention's splits, where the token's splits are combined after."""
    ids = _ids(served, text)
    assert text != LONG_PROMPT or len(ids) > 3 * kernels().ATTENTION_SPLIT
    whole = PackedKV(served)
    reference = whole.prefill([object()], [ids])[0].logits[-1]
    alone = PackedKV(served)
    row = object()
    alone.prefill([row], [ids[:-1]])
    assert torch.equal(alone.step([ids[-1:]])[0].logits[0], reference)
    busy = PackedKV(served)
    others = [_ids(served, f"Question {i}: what is {i} + {i}?") for i in range(15)]
    busy.prefill([object() for _ in others] + [object()], [*others, ids[:-1]])
    inputs = [other[: 1 + i % 8] for i, other in enumerate(others)] + [ids[-1:]]
    assert torch.equal(busy.step(inputs)[-1].logits[0], reference)


def test_attention_past_one_split_of_the_cache_is_the_references(served):
    """Past ATTENTION_SPLIT positions a head's attention is weighed split by split and the splits combined, over an
    fp16 cache: after three splits of a repeated request, the logits are as close to the float32 reference's as in
    the first split (int8 activations keep them a few percent apart), and greedy picks the same tokens. Combining
    splits without rescaling each to the largest score would leave no token in common."""
    ids = _ids(served, LONG_PROMPT)
    split, n = kernels().ATTENTION_SPLIT, len(ids)
    assert n > 3 * split
    _, logits, _ = served.packed.forward(
        torch.tensor(ids), torch.zeros(n, dtype=torch.long), torch.arange(n), [served.packed.new_cache(n)]
    )
    with torch.no_grad():
        expected = load_model(DEFAULT_MODEL, dtype="float32").model(torch.tensor([ids])).logits[0]
    error = (logits - expected).norm(dim=-1) / expected.norm(dim=-1)
    agree = (logits.argmax(-1) == expected.argmax(-1)).float()
    assert error[:split].mean() < 0.06 and error[split:].mean() < 0.06
    assert agree[split:].mean() > 0.95


@pytest.mark.parametrize("cut", [40, 126], ids=["in-one-split", "across-splits"])
def test_a_token_tree_gives_each_branch_the_bits_of_that_branch_alone(served, cut):
    """One forward over an anchor and a tree of three branches (one off the first at its second token, one off the
    anchor), beside another request's row: every branch's logits are those of that branch verified as a draft alone,
    bit for bit, also where the branches run across one of attention's splits (a prompt of 126 tokens). Keeping the
    branch off the first moves it into place: the next token's logits are those after that branch alone."""
    ids = _ids(served, LONG_PROMPT)[:cut]
    first, second, third = [101, 202, 303, 404], [101, 505, 606], [707, 808]
    anchor, tree = 17, [101, 202, 303, 404, 505, 606, 707, 808]
    parents = [-1, 0, 1, 2, 3, 1, 5, 0, 7]  # the anchor, then each tree token's parent among the forward's tokens

    def alone(branch: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        kv, row = PackedKV(served), object()
        kv.prefill([row], [ids])
        logits = kv.step([[anchor, *branch]])[0].logits
        return logits, kv.step([[9]])[0].logits[0]

    kv, row, other = PackedKV(served), object(), object()
    kv.prefill([other, row], [_ids(served, PROMPTS[1]), ids])
    logits = kv.step([[5, 6], [anchor, *tree]], trees=[None, parents])[1].logits
    for rows, branch in (([0, 1, 2, 3, 4], first), ([0, 1, 5, 6], second), ([0, 7, 8], third)):
        assert torch.equal(logits[rows], alone(branch)[0])
    kv.keep(row, 1 + len(tree), [0, 1, 5, 6])
    assert kv.lengths[1] == len(ids) + 1 + len(second)
    assert torch.equal(kv.step([[5], [9]])[1].logits[0], alone(second)[1])


def test_both_instruction_sets_give_the_same_bits(served, monkeypatch):
    """Over a prompt past three of attention's splits, so the combination of splits is compared too."""
    ids = _ids(served, LONG_PROMPT)
    logits = {}
    for build in ("avx2", "avx512"):
        monkeypatch.setenv("DSPARK_KERNELS", build)
        model = PackedLlama(DEFAULT_MODEL)
        assert model.engine.kernels == kernels_name()  # asking for AVX-512 on a CPU without it runs AVX2
        if build == "avx512" and model.engine.kernels != "avx512":
            pytest.skip("this CPU has no AVX-512")
        tokens = torch.tensor(ids)
        positions = torch.arange(len(ids))
        _, logits[build], _ = model.forward(tokens, torch.zeros_like(tokens), positions, [model.new_cache(len(ids))])
    assert torch.equal(logits["avx2"], logits["avx512"])


def test_greedy_dspark_is_greedy_autoregressive_token_for_token(backends):
    plain, dspark = backends
    passes = {"plain": 0, "off": 0, "beside": 0}
    for text in PROMPTS:
        request = GenerationRequest(messages=[{"role": "user", "content": text}], max_tokens=48, temperature=0.0)
        expected = plain.complete(request)
        passes["plain"] += expected.stats.forward_passes
        for lookup in ("off", "beside"):
            drafted = dspark.complete(request.model_copy(update={"lookup": lookup}))
            assert drafted.token_ids == expected.token_ids, (text, lookup)
            passes[lookup] += drafted.stats.forward_passes
    assert passes["off"] < passes["plain"] and passes["beside"] < passes["plain"]


def test_a_greedy_request_decodes_the_same_alone_and_among_15_others(backends):
    plain, dspark = backends
    mine = GenerationRequest(messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=32, temperature=0.0)
    others = [
        GenerationRequest(messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=8 + i, temperature=0.0)
        for i in range(15)
    ]
    for backend in (plain, dspark):
        alone = backend.complete(mine)
        together, records = complete_together(backend, [*others, mine])
        assert together[-1].token_ids == alone.token_ids
        assert max(r.rows for r in records) == 16


def test_served_drafters_read_the_lm_heads_gguf_blocks(served, backends):
    """The published drafter's draft vocabulary is read from the GGUF's 8-bit rows of the LM head and its backbone
    from Q8_0 blocks: its logits stay within 2% of the float32 rows' (they only propose; verification is exact)."""
    drafter = backends[1].drafter
    assert drafter.vocab.packed is not None and drafter.packed is not None
    hidden = torch.randn(3, served.packed.shape.hidden, generator=torch.Generator().manual_seed(0))
    packed = drafter.vocab.logits(hidden)
    exact = torch.nn.functional.linear(hidden, drafter.vocab.weight)
    assert ((packed - exact).norm(dim=-1) / exact.norm(dim=-1)).max() < 0.02


def _drafted(drafter, features: torch.Tensor, anchors: list[int], cuts: list[int]):
    """The context cache and each block's hidden states after committing ``features`` in pieces (ending at
    ``cuts``), each followed by a block from its anchor."""
    context, hidden, start = drafter.new_context(), [], 0
    for end, anchor in zip(cuts, anchors, strict=True):
        drafter.extend_context(context, features[start:end])
        hidden.append(drafter.draft_hidden(context, anchor))
        start = end
    return context, torch.stack(hidden)


@torch.inference_mode()
def test_the_served_drafters_backbone_is_its_torch_layers_in_one_compiled_call(served, backends, monkeypatch):
    """The published drafter's backbone runs as one compiled call (``drafter_block.h``): the context's keys and
    values and each block's hidden states are those of its torch layers multiplying the same Q8_0 blocks, to
    float32 rounding where no int8 activation rounds the other way (within 1% where one does: the block attends
    both ways, so one flip reaches every position), through a context cache that grew twice; and within the
    blocks' rounding of the float32 layers'."""
    monkeypatch.setattr("backends.dspark.drafter.ContextCache.FIRST_CAPACITY", 16)
    drafter = backends[1].drafter
    ids = _ids(served, PROMPTS[0] + " Add a docstring, type hints and three tests.")
    n = len(ids)
    _, _, states = served.packed.forward(
        torch.tensor(ids), torch.zeros(n, dtype=torch.long), torch.arange(n), [served.packed.new_cache(n)], True
    )
    features = torch.cat([states[i + 1] for i in drafter.config.target_layer_ids], dim=-1)
    cuts = [12, 13, 30, n]
    anchors = [ids[12], ids[13], ids[30], 5]
    context, hidden = _drafted(drafter, features, anchors, cuts)
    assert context.keys.shape[2] > 32 and context.length == n
    layers, fc, packed = drafter.layers, drafter.fc, drafter.packed
    blocks = copy.deepcopy(layers)
    for module in [*blocks.modules()]:
        for name, child in [*module.named_children()]:
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, PackedLinear.quantized(child))
    try:
        drafter.packed = None
        _, float_hidden = _drafted(drafter, features, anchors, cuts)
        drafter.layers, drafter.fc = blocks, PackedLinear.quantized(fc)
        torch_context, torch_hidden = _drafted(drafter, features, anchors, cuts)
    finally:
        drafter.layers, drafter.fc, drafter.packed = layers, fc, packed

    def error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a - b).norm(dim=-1) / b.norm(dim=-1)

    for mine, theirs in ((context.keys, torch_context.keys), (context.values, torch_context.values)):
        assert error(mine[:, :, :n], theirs[:, :, :n]).max() < 1e-5
    assert error(hidden, torch_hidden).max() < 0.01 and error(hidden, torch_hidden).median() < 1e-5
    assert error(hidden, float_hidden).max() < 0.04


def test_the_served_markov_stage_is_its_torch_loop_in_one_compiled_call(served, backends):
    """A greedy round's sequential stage (``PackedMatrix.greedy_chain``) picks the tokens the torch loop picks on
    the same Q8_0 transition blocks: from the drafter's own base logits, and from base logits so flat that the
    transition bias decides (where a chain that ignored it, or lost the previous token, would differ)."""
    drafter = backends[1].drafter
    head, vocab = drafter.markov_head, drafter.vocab
    w2 = head.markov_w2
    assert w2.matrix is not None
    ids = _ids(served, PROMPTS[0])
    n = len(ids)
    _, _, states = served.packed.forward(
        torch.tensor(ids), torch.zeros(n, dtype=torch.long), torch.arange(n), [served.packed.new_cache(n)], True
    )
    context = drafter.new_context()
    drafter.extend_context(context, torch.cat([states[i + 1] for i in drafter.config.target_layer_ids], dim=-1))
    generator = torch.Generator().manual_seed(0)
    bases = [drafter.base_logits(drafter.draft_hidden(context, anchor)) for anchor in ids[-3:]]
    bases += [1e-3 * torch.randn(drafter.block_size, vocab.size, generator=generator) for _ in range(3)]
    anchors = [*ids[-3:], *ids[:3]]
    compiled = [head.greedy(base, anchor, vocab) for base, anchor in zip(bases, anchors)]
    try:
        head.markov_w2 = PackedLinear(w2.matmul, w2.out_features, w2.in_features)
        looped = [head.greedy(base, anchor, vocab) for base, anchor in zip(bases, anchors)]
    finally:
        head.markov_w2 = w2
    assert compiled == looped
    plain = [vocab.target_ids(base.argmax(dim=-1)).tolist() for base in bases[3:]]
    assert all(chain != argmax for chain, argmax in zip(compiled[3:], plain))


def test_pools_on_one_model_share_one_packed_copy(served, backends):
    plain, dspark = backends
    assert plain.loaded.packed is dspark.loaded.packed is served.packed


def test_a_cache_that_grows_keeps_every_position(served, monkeypatch):
    """A request's cache doubles when a forward would run past it; what it held comes along exactly."""
    ids = _ids(served, PROMPTS[0])
    roomy, row = PackedKV(served), object()
    expected = [roomy.prefill([row], [ids[:4]])[0].logits]
    expected += [roomy.step([[token]])[0].logits for token in ids[4:]]
    monkeypatch.setattr("backends.packed.kv.FIRST_ROOM", 1)
    tight, row = PackedKV(served), object()
    logits = [tight.prefill([row], [ids[:4]])[0].logits]
    logits += [tight.step([[token]])[0].logits for token in ids[4:]]
    assert tight.caches[0][1].shape[2] > 16 and torch.equal(torch.cat(logits), torch.cat(expected))  # it grew from 16


def _records(served) -> list[Distilled]:
    return [
        Distilled(i, "test", _ids(served, text), _ids(served, text)[-6:] * (i + 1)) for i, text in enumerate(PROMPTS)
    ]


def test_the_drafters_features_are_the_served_engines_numbers(served, tmp_path):
    """The training features of several sequences read side by side are each sequence's own forward through the
    packed engine, bit for bit; cached on disk in bfloat16 they load back as the same bits."""
    records = _records(served)
    layer_ids = [1, 12, 26]
    cache = build_feature_cache(served, records, layer_ids)
    assert cache.features.dtype == torch.float32
    for index, record in enumerate(records):
        n = len(record.tokens)
        alone = served.packed.new_cache(n)
        last, logits, states = served.packed.forward(
            torch.tensor(record.tokens), torch.zeros(n, dtype=torch.long), torch.arange(n), [alone], states=True
        )
        rows = cache.span(index)
        assert torch.equal(cache.features[rows], torch.cat([states[i + 1] for i in layer_ids], dim=-1))
        assert torch.equal(cache.final[rows], last) and torch.equal(cache.lse[rows], torch.logsumexp(logits, -1))
    build_feature_cache(served, records, layer_ids, dtype=torch.bfloat16, folder=tmp_path).save(tmp_path)
    loaded = FeatureCache.load(tmp_path)
    assert FeatureCache.exists(tmp_path, layer_ids) and loaded.mapped_from == tmp_path
    assert torch.equal(loaded.features, cache.features.bfloat16()) and torch.equal(loaded.final, cache.final.bfloat16())
    assert torch.equal(loaded.tokens, torch.tensor([t for r in records for t in r.tokens]))


class Killed(Exception):
    """The process stopping mid-build."""


def test_an_interrupted_feature_build_resumes_after_its_last_group(served, tmp_path, monkeypatch):
    """Killed after its first group, a build into a folder computes only the groups it had not written when run
    again, and ends with the cache an uninterrupted build makes."""
    records, layer_ids = _records(served), [2, 20]
    monkeypatch.setattr(feature_cache, "FORWARD_TOKENS", 64)  # one sequence a group
    whole = build_feature_cache(served, records, layer_ids, dtype=torch.bfloat16)
    forward, calls, killing = feature_cache._packed_forward, [], [True]

    def counted(loaded, sequences, ids):
        calls.append(len(sequences))
        if killing[0] and len(calls) == 2:
            raise Killed
        return forward(loaded, sequences, ids)

    monkeypatch.setattr(feature_cache, "_packed_forward", counted)
    with pytest.raises(Killed):
        build_feature_cache(served, records, layer_ids, dtype=torch.bfloat16, folder=tmp_path)
    calls.clear()
    killing[0] = False
    build_feature_cache(served, records, layer_ids, dtype=torch.bfloat16, folder=tmp_path).save(tmp_path)
    assert calls == [1, 1]
    resumed = FeatureCache.load(tmp_path)
    for name in ("features", "final", "lse"):
        assert torch.equal(getattr(resumed, name), getattr(whole, name)), name
