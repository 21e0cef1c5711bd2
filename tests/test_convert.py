"""The default model's conversion, on a tiny GGUF written here by the ``gguf`` package: the converted folder is
an ordinary Hugging Face model with the GGUF's weights, tokenizer and chat template, and beside it the GGUF's own
blocks, which the packed engine multiplies by exactly as gguf dequantises them; a wrong checksum is refused; a
second conversion of the same file does nothing."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from backends.convert import MARKER, convert, sha256_of
from backends.default_model import DEFAULT_MODEL, GGUF_SHA256
from backends.errors import ModelLoadError
from backends.loading import load_model
from backends.modelfactory import CHAT_TEMPLATE, build_model
from backends.packed.linear import PackedLinear
from backends.packed.model import PackedLlama
from backends.precision import QUANTIZED_PRECISION


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q and k rows interleaved per rotary pair; its converter permutes them so, and
    transformers undoes it when it reads a GGUF."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(model, tokenizer, path, blocks: gguf.GGMLQuantizationType | None = None) -> None:
    """``model`` (a Llama) and its byte-level BPE tokenizer as llama.cpp's converter writes them, in float32, or with
    every weight matrix in ``blocks`` (the embedding in Q8_0, as llama.cpp's Q4_1 files have it)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(vocab["vocab"].items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def add_matrix(name: str, values: np.ndarray, kind: gguf.GGMLQuantizationType | None = blocks) -> None:
        if kind is None:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    add_matrix("token_embd.weight", state["model.embed_tokens.weight"], blocks and gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        add_matrix(f"blk.{i}.attn_q.weight", _llama_cpp_permute(state[prefix + "self_attn.q_proj.weight"], heads))
        add_matrix(f"blk.{i}.attn_k.weight", _llama_cpp_permute(state[prefix + "self_attn.k_proj.weight"], kv_heads))
        for ours, theirs in names.items():
            values = state[prefix + ours + ".weight"]
            if values.ndim == 1:
                writer.add_tensor(f"blk.{i}.{theirs}.weight", values)
            else:
                add_matrix(f"blk.{i}.{theirs}.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_tokenizer):
    model = build_model("llama", tiny_tokenizer, hidden=64, layers=2, heads=4, seed=3)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(model, tiny_tokenizer, path)
    return path, model


def test_conversion_gives_a_hugging_face_folder_with_the_gguf_model(tiny_gguf, tiny_tokenizer, tmp_path):
    path, reference = tiny_gguf
    out = convert(path, tmp_path / "model", sha256_of(path))
    loaded = load_model(out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    ids = torch.tensor([tiny_tokenizer("def add(a, b):\n    return a + b")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
    text = "x = [1, 2, 3]"
    assert loaded.tokenizer(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.tokenizer.apply_chat_template(messages, tokenize=False) == tiny_tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    assert json.loads((out / MARKER).read_text())["sha256"] == sha256_of(path)


def test_converting_again_does_nothing_and_a_wrong_checksum_is_refused(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = convert(path, tmp_path / "model")
    written = (out / "model.safetensors").stat().st_mtime_ns
    convert(path, out)
    assert (out / "model.safetensors").stat().st_mtime_ns == written
    with pytest.raises(ModelLoadError, match="sha256"):
        convert(path, tmp_path / "other", "0" * 64)
    assert not (tmp_path / "other").exists()


def test_the_default_model_is_the_pinned_wheels_gguf():
    """make converts the default model before the tests run; its folder records the pinned file's checksum."""
    assert json.loads((DEFAULT_MODEL / MARKER).read_text())["sha256"] == GGUF_SHA256


@pytest.fixture(scope="module")
def q4_folder(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama written as a Q4_1 GGUF (embedding in Q8_0), converted: the float32 reference and its blocks."""
    model = build_model("llama", tiny_tokenizer, hidden=64, layers=2, heads=4, seed=3)
    root = tmp_path_factory.mktemp("gguf-q4")
    write_gguf(model, tiny_tokenizer, root / "tiny-q4_1.gguf", gguf.GGMLQuantizationType.Q4_1)
    return root / "tiny-q4_1.gguf", convert(root / "tiny-q4_1.gguf", root / "model")


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, K] as the engine rounds activations (llama.cpp's Q8_1): per block of 32, q = round(x / d) with
    d = max |x| / 127, in float64 as d * q."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).double() * d.double()).reshape(x.shape)


def test_packed_blocks_multiply_as_the_gguf_weights_by_int8_activations(q4_folder):
    """Each matrix the engine multiplies by (query, key and value stacked by rows, gate and up too; the tied LM
    head is the embedding) is gguf's own dequantisation of its blocks, met by activations rounded to int8 per
    block of 32: the product equals that of the float64 reference to float32 rounding. The embedding is looked up,
    and its rows are gguf's dequantisation bit for bit."""
    path, folder = q4_folder
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    expected = [stored["token_embd.weight"]]
    for i in range(2):
        block = f"blk.{i}."
        expected += [
            np.concatenate([stored[block + n] for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]),
            stored[block + "attn_output.weight"],
            np.concatenate([stored[block + n] for n in ("ffn_gate.weight", "ffn_up.weight")]),
            stored[block + "ffn_down.weight"],
        ]
    packed = PackedLlama(folder)
    generator = torch.Generator().manual_seed(0)
    for index, weights in enumerate(expected, start=1):
        w = torch.from_numpy(weights).double()
        x = torch.randn(9, w.shape[1], generator=generator) * torch.rand(9, 1, generator=generator)
        x[3] = 0.0  # a row of zeros rounds to zeros
        reference = int8_blocks(x) @ w.T
        scale = (x.abs().double() @ w.abs().T).max()
        product = packed.engine.matmul(index, x).double()
        torch.testing.assert_close(product, reference, rtol=0, atol=1e-6 * scale.item(), msg=f"matrix {index}")
    tokens = torch.randperm(expected[0].shape[0], generator=generator)[:64]
    positions = torch.arange(len(tokens))
    cache = packed.new_cache(len(tokens))
    _, _, layers = packed.forward(tokens, torch.zeros_like(tokens), positions, [cache], states=True)
    assert torch.equal(layers[0], torch.from_numpy(expected[0])[tokens])


def test_a_converted_gguf_is_served_from_its_blocks_with_the_reference_logits(q4_folder, tiny_tokenizer):
    _, folder = q4_folder
    served, reference = load_model(folder), load_model(folder, dtype="float32")
    assert served.precision == QUANTIZED_PRECISION and reference.packed is None
    ids = torch.tensor(tiny_tokenizer("def add(a, b):\n    return a + b")["input_ids"])
    positions = torch.arange(len(ids))
    _, logits, _ = served.packed.forward(ids, torch.zeros_like(ids), positions, [served.packed.new_cache(len(ids))])
    with torch.no_grad():
        expected = reference.model(ids[None]).logits[0]
    error = (logits - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < 0.02  # int8 activations, as llama.cpp rounds them: about 1% of the logits here


def test_a_linear_layer_served_from_q8_0_blocks_multiplies_as_its_rounded_weights():
    """A drafter's layers are served from Q8_0 blocks: the product is gguf's Q8_0 rounding of the weight met by
    int8 activations, to float32 rounding, and a rows count that is no multiple of 16 (a padded tile) is kept."""
    generator = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(96, 40, bias=True)
    torch.nn.init.normal_(linear.weight, generator=generator)
    packed = PackedLinear.quantized(linear)
    rounded = gguf.quants.quantize(linear.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
    w = torch.from_numpy(gguf.quants.dequantize(rounded, gguf.GGMLQuantizationType.Q8_0)).double()
    x = torch.randn(2, 3, 96, generator=generator)
    reference = (int8_blocks(x.reshape(6, 96)) @ w.T).reshape(2, 3, 40) + linear.bias.detach().double()
    scale = (x.reshape(6, 96).abs().double() @ w.abs().T).max().item()
    torch.testing.assert_close(packed(x).double(), reference, rtol=0, atol=1e-6 * scale)
