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
from backends.packed.kv import PackedKV
from backends.packed.model import QUANTIZED_PRECISION, PackedLlama


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


def test_packed_blocks_multiply_as_the_gguf_dequantised_weights_exactly(q4_folder):
    """Each matrix the engine holds, times the identity, is gguf's own dequantisation of its blocks, bit for bit
    (query, key and value stacked by rows, gate and up too; the tied LM head is the embedding)."""
    path, folder = q4_folder
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    expected = [stored["token_embd.weight"], stored["token_embd.weight"]]
    for i in range(2):
        block = f"blk.{i}."
        expected += [
            np.concatenate([stored[block + n] for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]),
            stored[block + "attn_output.weight"],
            np.concatenate([stored[block + n] for n in ("ffn_gate.weight", "ffn_up.weight")]),
            stored[block + "ffn_down.weight"],
        ]
    packed = PackedLlama(folder)
    for index, weights in enumerate(expected):
        identity = torch.eye(weights.shape[1])
        assert torch.equal(packed.engine.matmul(index, identity), torch.from_numpy(weights).T), index


def test_a_converted_gguf_is_served_from_its_blocks_with_the_reference_logits(q4_folder, tiny_tokenizer):
    _, folder = q4_folder
    served, reference = load_model(folder), load_model(folder, dtype="float32")
    assert served.precision == QUANTIZED_PRECISION and reference.packed is None
    ids = tiny_tokenizer("def add(a, b):\n    return a + b")["input_ids"]
    kv, row = PackedKV(served), object()
    logits = kv.prefill([row], [ids])[0].logits
    with torch.no_grad():
        torch.testing.assert_close(logits, reference.model(torch.tensor([ids])).logits[0], rtol=1e-4, atol=1e-4)
