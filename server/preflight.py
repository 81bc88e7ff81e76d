"""The model folder, checked before the engine loads the weights.

Loading takes minutes on a GPU, and the API process reads the folder's tokenizer, chat
template and image processor only once the engine is ready: a broken file there made a
server load its weights and then fail with tracebacks (uvicorn's exit 3), a missing
preprocessor_config.json refused every image, and a chat template with a syntax error
failed every chat with a 400 that blamed the client. `check_model_folder` reads all of it
first, as the server will, and `tessera serve` turns what it finds into one line and
exit 1. It also opens each *.safetensors file's header (not its data), and checks the
settings the engine would refuse only after it had started (a device this machine lacks,
an attention backend it cannot run, a KV cache bigger than its memory): those are one line
and exit 2, as other settings mistakes are.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.attention import check_attention_backend
from engine.device_config import (
    check_tensor_parallel_device,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    usable_device,
)
from engine.errors import ModelLoadError
from engine.kv_cache_sizing import check_kv_cache_fits, kv_block_bytes
from engine.model_config import ModelConfig, check_max_model_len
from engine.models.loader import open_checkpoint
from engine.multimodal.chat_template import syntax_error
from engine.multimodal.image_processor import ImageProcessorConfig
from engine.multimodal.prompt import PromptProcessor
from server.settings import SettingsError

if TYPE_CHECKING:
    import torch

    from engine.config import EngineConfig
    from server.settings import ServerSettings


def check_model_folder(settings: ServerSettings) -> None:
    """Raises ModelLoadError naming what in the model folder the server cannot use, and
    SettingsError for a setting this machine cannot run."""
    device = _device(settings.engine)
    folder = Path(settings.engine.model)  # "~" expanded as the settings were read
    model_config = ModelConfig.from_model_dir(folder)  # a missing folder is named here
    # Settings this model cannot take: a settings mistake (exit 2), named where it was set.
    try:
        check_max_model_len(settings.engine.max_model_len, model_config)
    except ModelLoadError as exc:
        raise SettingsError(exc.message, ("max_model_len",)) from None
    try:
        model_config.shard(settings.engine.tensor_parallel_size)  # a size it cannot split into
    except ModelLoadError as exc:
        raise SettingsError(exc.message, ("tensor_parallel_size",)) from None
    _check_engine_settings(settings.engine, device, model_config)
    check_safetensors_headers(folder)
    template_setting = settings.chat_template_source()
    processor = PromptProcessor.from_model_dir(folder, template_setting)
    if template_setting is None:  # a --chat-template was checked as the settings were read
        for template in (processor.chat_template, processor.tool_chat_template):
            if template is not None and (error := syntax_error(template)) is not None:
                raise ModelLoadError(f"the model folder's chat template has {error}")
    if model_config.vision is not None:
        ImageProcessorConfig.from_model_dir(folder)  # the server preprocesses images with it


def check_safetensors_headers(folder: Path) -> None:
    """ModelLoadError for an empty, truncated or garbled *.safetensors file: safe_open reads
    the header alone, and checks that the file holds every byte its tensors' offsets name."""
    for path in sorted(folder.glob("*.safetensors")):
        with open_checkpoint(path):
            pass


def _device(engine: EngineConfig) -> torch.device:
    if engine.device == "auto":
        return resolve_device("auto")
    try:
        return usable_device(engine.device, "device")  # cuda without CUDA, cuda:N past the last
    except ValueError as exc:
        raise SettingsError(str(exc), ("device",)) from None


def _check_engine_settings(engine: EngineConfig, device: torch.device, model: ModelConfig) -> None:
    """Tensor parallelism on this device (gloo ranks: CPU only); the attention backend on
    this device and dtype; an exact --num-kv-blocks against the memory this process may
    use, its cgroup's limit included (on CUDA, the engine catches an allocation that
    fails)."""
    try:  # the engine refused it only once started, with exit 1 (fuzz84)
        check_tensor_parallel_device(engine.tensor_parallel_size, device)
    except ValueError as exc:
        raise SettingsError(str(exc), ("tensor_parallel_size", "device")) from None
    dtype = resolve_dtype(engine.dtype, device, model.torch_dtype)
    try:
        check_attention_backend(engine.attention_backend, device, dtype)
    except ValueError as exc:
        raise SettingsError(str(exc), ("attention_backend", "device", "dtype")) from None
    if engine.num_kv_blocks is None:
        return
    kv_dtype = resolve_kv_cache_dtype(engine.kv_cache_dtype, dtype, engine.kv_cache_scale)
    num_bytes = (engine.num_kv_blocks + 1) * kv_block_bytes(model, engine.block_size, kv_dtype)
    try:  # + 1: the scratch block
        check_kv_cache_fits(engine.num_kv_blocks, num_bytes, device)
    except ValueError as exc:  # MemoryBudgetError
        raise SettingsError(str(exc), ("num_kv_blocks",)) from None
