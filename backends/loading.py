"""Load a Hugging Face causal LM and its tokenizer from a local path, and turn requests into prompt ids.

Nothing here reaches a model hub: a path that does not exist or holds no model is a
:class:`~backends.errors.ModelLoadError`, raised before anything else is tried.
"""

from __future__ import annotations

import platform
import threading
import weakref
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from jinja2 import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from backends.errors import InvalidRequestError, ModelLoadError
from backends.packed.build import usable as packed_usable
from backends.packed.model import QUANTIZED_PRECISION, PackedLlama, has_packed
from backends.prompting import prompt_messages
from backends.types import GenerationRequest

# transformers' from_pretrained builds models through process-wide state (the meta device), so two threads
# loading at once corrupt each other's models: every load in the process takes this lock.
_LOAD_LOCK = threading.Lock()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRECISIONS = ("auto", QUANTIZED_PRECISION, *DTYPES)
"""What a pool's ``dtype`` may say: ``gguf`` serves the GGUF's own blocks on the packed engine."""
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
BF16_MIN_WEIGHT_BYTES = 100_000_000
"""``auto`` runs a model in bfloat16 on a CPU from this size of float32 weights: there a forward is bound by
reading the weights, and a verifying pass of 8 tokens costs 1.2 single steps in bfloat16 against 2.2 in float32
(SmolLM2-135M, 2 threads, Sapphire Rapids). Below it a forward is interpreter overhead that bfloat16 cannot cut,
and float32 stays the exact reference."""
_SHARED: weakref.WeakValueDictionary[tuple[str, str, str], LoadedModel] = weakref.WeakValueDictionary()


@dataclass
class LoadedModel:
    model: PreTrainedModel
    """The transformers model: what serves where nothing is packed, and the float32 reference (its embedding and LM
    head are the drafters') where something is."""
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    eos_ids: frozenset[int]
    max_context: int | None
    path: Path
    packed: PackedLlama | None = None
    """The packed engine serving the folder's GGUF blocks, when it serves (:func:`resolve_precision`)."""

    @property
    def precision(self) -> torch.dtype | str:
        """What every forward runs in, as machine keys name it."""
        return QUANTIZED_PRECISION if self.packed is not None else self.model.dtype


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise InvalidRequestError(f"unknown device {device!r}", param="device") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device 'cuda' asked for but CUDA is not available", param="device")
    return resolved


@cache
def _cpu_fields() -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}


def cpu_name() -> str:
    """The CPU's model name: machines differ, so a stored cost curve and every benchmark figure say which one
    measured them (``platform.processor()`` says only ``x86_64`` on Linux)."""
    return _cpu_fields().get("model name") or platform.processor() or platform.machine()


def cpu_generation() -> str | None:
    """The CPU's family and model numbers (``family 23 model 1``), which tell apart what a cloud's model name does
    not: its "AMD EPYC" has been a Zen 1 with AVX2 alone and a Zen 4 with AVX-512, at four times the speed apart.
    None where ``/proc/cpuinfo`` does not say."""
    fields = _cpu_fields()
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX-512 BF16): elsewhere bfloat16 is emulated and
    slower than float32. Read once: training asks at every step."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def bfloat16_autocast(device: torch.device, wanted: bool = True) -> torch.autocast:
    """Training's matrix work in bfloat16 where it pays: on GPUs, and on CPUs that multiply it natively
    (:func:`cpu_has_bf16`). Elsewhere it stays float32: on an AVX2-only EPYC a training step of the published
    drafter took about 60 s in emulated bfloat16 and 2.7 s in float32."""
    enabled = wanted and (device.type != "cpu" or cpu_has_bf16())
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def resolve_dtype(dtype: str, device: torch.device, path: Path | None = None) -> torch.dtype:
    """``auto``: bfloat16 on GPUs; on a CPU bfloat16 where it has the instructions and the model is big enough for
    it to pay (:data:`BF16_MIN_WEIGHT_BYTES`), float32 otherwise."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) if path is not None else 0
        return torch.bfloat16 if cpu_has_bf16() and weights >= BF16_MIN_WEIGHT_BYTES else torch.float32
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {', '.join(PRECISIONS)}; got {dtype!r}", param="dtype")
    return DTYPES[dtype]


def resolve_precision(dtype: str, device: torch.device, path: Path | None) -> torch.dtype | str:
    """``gguf`` (the packed engine on the folder's GGUF blocks) where ``dtype`` is ``auto`` or ``gguf``, the device a
    CPU with the kernels' instructions and the folder was converted from a GGUF they read; else
    :func:`resolve_dtype`. The packed engine is the default because it reads 4-bit blocks, not float copies of them,
    and gives every token the same logits whatever shares its forward (greedy speculative decoding is then exactly
    plain decoding)."""
    packable = device.type == "cpu" and path is not None and has_packed(path) and packed_usable()
    if dtype == QUANTIZED_PRECISION and not packable:
        raise InvalidRequestError(
            "dtype gguf needs a folder converted from a GGUF with Q4_1, Q8_0 or float blocks (dspark-router convert) "
            "and an x86-64 CPU with AVX2",
            param="dtype",
        )
    if dtype in ("auto", QUANTIZED_PRECISION) and packable:
        return QUANTIZED_PRECISION
    return resolve_dtype(dtype, device, path)


def load_shared(path: str | Path, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """:func:`load_model`, but one copy per folder, device and dtype in the process: two pools (or two workers)
    on the same model share its weights, which inference never writes. The copy lives while a backend holds it."""
    key = (str(Path(path).resolve()), device, dtype)
    with _LOAD_LOCK:
        loaded = _SHARED.get(key)
    if loaded is None:
        loaded = load_model(path, device=device, dtype=dtype)
        with _LOAD_LOCK:
            loaded = _SHARED.setdefault(key, loaded)
    return loaded


def load_model(path: str | Path, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """A private copy of the model (training, tests that change weights); backends use :func:`load_shared`."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} does not exist or is not a directory", param="model")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model path {str(path)!r} holds no model (no config.json)", param="model")
    torch_device = resolve_device(device)
    hf_logging.disable_progress_bar()
    precision = resolve_precision(dtype, torch_device, path)
    torch_dtype = torch.float32 if precision == QUANTIZED_PRECISION else precision
    try:
        with _LOAD_LOCK:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {str(path)!r}: {exc}", param="model") from exc
    model.to(torch_device).eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=torch_device,
        eos_ids=_eos_ids(model, tokenizer),
        max_context=_max_context(model),
        path=path,
        packed=PackedLlama(path) if precision == QUANTIZED_PRECISION else None,
    )


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = set()
    configured = model.generation_config.eos_token_id if model.generation_config else None
    for value in (configured, tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, list) else [value])
    return frozenset(ids)


def _max_context(model: PreTrainedModel) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(model.config, key, None)
        if value:
            return int(value)
    return None


def prompt_ids(loaded: LoadedModel, request: GenerationRequest) -> list[int]:
    """Token ids of the prompt: the chat template for messages (with format and tool notes), the raw text
    otherwise."""
    tokenizer = loaded.tokenizer
    if request.messages is not None:
        if not tokenizer.chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template; send a prompt", param="messages")
        messages = prompt_messages(
            [m.model_dump(exclude_none=True) for m in request.messages], request.response_format, request.tools
        )
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except TemplateError as exc:  # the template's own refusal (a role order it rejects): the request's fault
            raise InvalidRequestError(
                f"the model's chat template refuses these messages: {exc}", param="messages"
            ) from exc
        ids = list(ids)
    else:
        ids = tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise InvalidRequestError("the prompt encodes to no tokens", param="prompt")
    if loaded.max_context is not None and len(ids) + request.max_tokens > loaded.max_context:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) plus max_tokens ({request.max_tokens}) exceeds the model's context "
            f"of {loaded.max_context} tokens",
            param="max_tokens",
        )
    return ids
