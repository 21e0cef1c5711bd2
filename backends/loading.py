"""Load a Hugging Face causal LM and its tokenizer from a local path, and turn requests into prompt ids.

Nothing here reaches a model hub: a path that does not exist or holds no model is a
:class:`~backends.errors.ModelLoadError`, raised before anything else is tried.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from jinja2 import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from backends.errors import InvalidRequestError, ModelLoadError
from backends.packed.build import usable as packed_usable
from backends.packed.model import PackedLlama
from backends.precision import QUANTIZED_PRECISION, cpu_has_bf16, dtype_name, precision_name
from backends.prompting import prompt_messages
from backends.types import GenerationRequest

# transformers' from_pretrained builds models through process-wide state (the meta device), so two threads
# loading at once corrupt each other's models: every load in the process takes this lock.
_LOAD_LOCK = threading.Lock()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHARED: weakref.WeakValueDictionary[tuple[str, str, str, int | None], LoadedModel] = weakref.WeakValueDictionary()


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

    @property
    def threads(self) -> int:
        """The threads every forward runs on: the packed engine's pool, else torch's."""
        return self.packed.pool.threads if self.packed is not None else torch.get_num_threads()


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


def bfloat16_autocast(device: torch.device, wanted: bool = True) -> torch.autocast:
    """Training's matrix work in bfloat16 where it pays: on GPUs, and on CPUs that multiply it natively
    (:func:`cpu_has_bf16`). Elsewhere it stays float32: on an AVX2-only EPYC a training step of the published
    drafter took about 60 s in emulated bfloat16 and 2.7 s in float32."""
    enabled = wanted and (device.type != "cpu" or cpu_has_bf16())
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def resolve_dtype(dtype: str, device: torch.device, path: Path | None = None) -> torch.dtype:
    """:func:`~backends.precision.dtype_name` as a torch dtype."""
    try:
        return DTYPES[dtype_name(dtype, device.type, path)]
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="dtype") from None


def resolve_precision(dtype: str, device: torch.device, path: Path | None) -> torch.dtype | str:
    """:func:`~backends.precision.precision_name` where the kernels build here: ``gguf``, else a torch dtype."""
    try:
        name = precision_name(dtype, device.type, path, packed_usable)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="dtype") from None
    return name if name == QUANTIZED_PRECISION else DTYPES[name]


def load_shared(path: str | Path, device: str = "auto", dtype: str = "auto", threads: int | None = None) -> LoadedModel:
    """:func:`load_model`, but one copy per folder, device, dtype and threads in the process: two pools (or two
    workers) on the same model share its weights, which inference never writes. The copy lives while a backend
    holds it."""
    key = (str(Path(path).resolve()), device, dtype, threads)
    with _LOAD_LOCK:
        loaded = _SHARED.get(key)
    if loaded is None:
        loaded = load_model(path, device=device, dtype=dtype, threads=threads)
        with _LOAD_LOCK:
            loaded = _SHARED.setdefault(key, loaded)
    return loaded


def load_model(path: str | Path, device: str = "auto", dtype: str = "auto", threads: int | None = None) -> LoadedModel:
    """A private copy of the model (training, tests that change weights); backends use :func:`load_shared`.
    ``threads``: the packed engine's (None: :func:`~backends.packed.pool.default_threads`)."""
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
        packed=PackedLlama(path, threads) if precision == QUANTIZED_PRECISION else None,
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
