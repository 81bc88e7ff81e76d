"""How many KV-cache blocks the engine allocates at start-up.

The first setting that applies decides:

    num_kv_blocks            exactly that many blocks (tests force preemption with it);
    kv_cache_memory_gib      that much memory;
    neither, on CUDA         what `gpu_memory_utilization` x the device's memory leaves
                             after the weights and the largest step (profiled, below);
    neither, on CPU          CPU_KV_CACHE_GIB.

Sizing on CUDA works the way vLLM's memory profiling does. A fixed size either wastes
most of an 80 GB GPU or does not fit a small one:

1. Before the weights load, note the device memory already in use (other processes,
   this process's CUDA context). If less than `utilization x total` is free, fail now
   and say so.
2. Load the weights. Then run the largest step the scheduler can build against a
   scratch KV cache (`run_largest_step`) and read PyTorch's peak allocation (the weights
   included).
3. The KV cache gets `utilization x total`, less that peak, less what the process
   holds outside PyTorch's allocator (CUDA libraries' own allocations), less what a full
   encoder cache will hold (`encoder_cache_bytes`: `encoder_cache_tokens` rows of the
   encoder's width, which for Qwen3-VL is the decoder's hidden size times 1 + its
   deepstack levels).

What this does not count: CUDA-graph pools, FlashInfer's plan buffers and the sampler's
table of held tokens (engine/held_tokens.py) are allocated after the KV cache, out of the
`1 - utilization` share (decode graphs are small next to a full prefill step; the table
is ~4 bytes per token of the running requests). With utilization 1.0 they have no room.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.base import AttentionMetadata
from engine.config import EngineConfig
from engine.device_io import to_device
from engine.model_config import ModelConfig
from engine.multimodal.image_processor import ImageProcessorConfig
from engine.prompt_logprobs import SLICE_ROWS, score_prompt_tokens
from engine.protocol import SamplingParams
from engine.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)

GIB = 2**30
CPU_KV_CACHE_GIB = 2.0


def heaviest_sampling(max_logprobs: int) -> SamplingParams:
    """The heaviest sampling a request can ask for: every filter, a penalty, a logit bias
    (its cost is a copy of the logits, whatever the number of tokens) and the most logprobs
    the server allows (`max_logprobs`)."""
    return SamplingParams(
        temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        logprobs=max_logprobs, logit_bias=((0, 1.0),),
    )  # fmt: skip


def kv_block_bytes(model_config: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype) -> int:
    """Bytes of one block (K and V) over all layers."""
    element = torch.empty((), dtype=kv_cache_dtype).element_size()
    per_layer = 2 * block_size * model_config.num_key_value_heads * model_config.head_dim
    return per_layer * element * model_config.num_hidden_layers


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One [num_blocks, 2, block_size, KV heads, head dim] cache per layer: the layout
    `kv_block_bytes` counts. Zeros, not empty: a backend may gather whole blocks and mask
    the tail, and masked garbage (NaN/inf) would still poison the weighted sum."""
    mc = model_config
    shape = (num_blocks, 2, block_size, mc.num_key_value_heads, mc.head_dim)
    num_bytes = num_blocks * kv_block_bytes(mc, block_size, dtype)
    check_kv_cache_fits(num_blocks - 1, num_bytes, device)
    try:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(mc.num_hidden_layers)]
    except RuntimeError as exc:  # CUDA's OutOfMemoryError; the CPU allocator's plain one
        if not isinstance(exc, torch.OutOfMemoryError) and "can't allocate" not in str(exc):
            raise
        raise MemoryBudgetError(
            _too_big(num_blocks - 1, num_bytes, f"the {device} device has free")
        ) from None


# Where the process's cgroups are listed, and where their files are (module attributes:
# tests point them at a folder of their own).
PROC_SELF_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


def machine_memory_bytes() -> tuple[int, str]:
    """The memory this process may use, and what bounds it: the machine's, or its
    cgroup's limit where that is lower (the kernel kills a process past it, where the
    machine's figure let a KV cache through that could never be filled)."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = cgroup_memory_limit()
    if limit is not None and limit < physical:
        return limit, "this container's memory limit is"
    return physical, "this machine has"


def cgroup_memory_limit() -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors (a systemd
    unit's MemoryMax=, a container's, one nested in either), v2 or v1; None: none set."""
    try:
        lines = Path(PROC_SELF_CGROUP).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:  # "0::/path" (v2) or "4:memory:/path" (v1)
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            folder, name = Path(CGROUP_ROOT), "memory.max"
        elif "memory" in controllers.split(","):
            folder, name = Path(CGROUP_ROOT) / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):  # the process's own cgroup up to the root
            try:
                text = (folder.joinpath(*parts[:depth]) / name).read_text().strip()
            except OSError:  # not mounted here (a private namespace shows "/")
                continue
            if text.isdigit():  # else "max": no limit at this level
                limits.append(int(text))
    return min(limits, default=None)


def check_kv_cache_fits(num_kv_blocks: int, num_bytes: int, device: torch.device) -> None:
    """Refuses a CPU KV cache of `num_kv_blocks` (plus the scratch block: `num_bytes` in all)
    larger than the memory this process may use before allocating it: the allocator's
    error was a traceback. (A CUDA device's is caught as it allocates.)"""
    if device.type != "cpu":
        return
    memory, bound = machine_memory_bytes()
    if num_bytes > memory:
        raise MemoryBudgetError(_too_big(num_kv_blocks, num_bytes, f"{bound} ({_size(memory)})"))


def _too_big(num_kv_blocks: int, num_bytes: int, has: str) -> str:
    return (
        f"num_kv_blocks={num_kv_blocks} needs {num_bytes} bytes ({_size(num_bytes)}) of KV "
        f"cache, more than {has}; lower --num-kv-blocks or --kv-cache-memory-gib"
    )


def _size(num_bytes: int) -> str:
    if num_bytes < GIB:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return (
        f"{num_bytes / GIB:.1f} GiB"
        if num_bytes < 1024 * GIB
        else f"{num_bytes / GIB / 1024:.1f} TiB"
    )


def blocks_in(num_bytes: int, block_bytes: int, useful_blocks: int) -> int:
    """Blocks for the scheduler in `num_bytes`: one goes to the scratch block (CUDA-graph
    padding writes there), and more than `useful_blocks` can never be used."""
    return max(1, min(num_bytes // block_bytes - 1, useful_blocks))


@dataclass(frozen=True)
class DeviceMemoryUse:
    """Bytes, read around the profiled step (`CudaMemoryProbe`)."""

    total: int  # the device's memory
    used_at_start: int  # in use by anyone before the weights loaded
    torch_peak: int  # PyTorch's peak allocation: weights + the largest step
    non_torch: int  # held by this process outside PyTorch's allocator since the start


class MemoryBudgetError(ValueError):
    """The settings leave no room for a KV cache on this device."""


def check_free_at_start(total: int, used_at_start: int, utilization: float) -> None:
    free = total - used_at_start
    if free < utilization * total:
        raise MemoryBudgetError(
            f"gpu_memory_utilization={utilization} asks for {utilization * total / GIB:.1f} "
            f"GiB of the device's {total / GIB:.1f} GiB, but only {free / GIB:.1f} GiB is "
            "free (other processes hold the rest); lower --gpu-memory-utilization or set "
            "--kv-cache-memory-gib"
        )


def kv_cache_bytes(
    use: DeviceMemoryUse, utilization: float, block_bytes: int, reserved: int = 0
) -> int:
    """What `utilization x total` leaves for the KV cache beside `reserved` bytes (the
    encoder cache); raises when not two blocks."""
    budget = int(utilization * use.total)
    left = budget - use.torch_peak - use.non_torch - reserved
    if left < 2 * block_bytes:  # one block for requests, one scratch block
        raise MemoryBudgetError(
            f"gpu_memory_utilization={utilization} of the device's {use.total / GIB:.1f} GiB "
            f"leaves no room for the KV cache: the weights and the largest step take "
            f"{use.torch_peak / GIB:.2f} GiB, other CUDA allocations "
            f"{use.non_torch / GIB:.2f} GiB, the encoder cache {reserved / GIB:.2f} GiB; "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens, "
            "--max-encoder-tokens-per-step or --encoder-cache-tokens, or set "
            "--kv-cache-memory-gib"
        )
    return left


def encoder_cache_bytes(model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """What a full encoder cache holds: `encoder_cache_tokens` rows of the encoder's width."""
    if model_config.vision is None:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    return config.encoder_cache_tokens * model_config.encoder_width * element


class CudaMemoryProbe:
    """Reads the device's memory before the weights load and after the profiled step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        free, self.total = torch.cuda.mem_get_info(device)
        self.used_at_start = self.total - free
        # PyTorch's share of it (e.g. a backend's workspace made before the weights).
        self.reserved_at_start = torch.cuda.memory_reserved(device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        """Hands the profiled step's cached activations back, for the KV cache."""
        torch.cuda.empty_cache()

    def read(self) -> DeviceMemoryUse:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        grown = (total - free) - self.used_at_start
        torch_grown = torch.cuda.memory_reserved(self.device) - self.reserved_at_start
        non_torch = max(0, grown - torch_grown)
        return DeviceMemoryUse(
            total=total,
            used_at_start=self.used_at_start,
            torch_peak=torch.cuda.max_memory_allocated(self.device),
            non_torch=non_torch,
        )


def largest_frame_grid(image_config: ImageProcessorConfig) -> tuple[int, int, int]:
    """grid_thw of the largest square frame the image processor makes (in patches)."""
    factor = image_config.factor
    side = max(factor, math.isqrt(image_config.max_pixels) // factor * factor)
    patches = side // image_config.patch_size
    return (1, patches, patches)


@torch.inference_mode()
def run_largest_step(
    model,
    config: EngineConfig,
    image_config: ImageProcessorConfig | None,
    *,
    max_model_len: int,
    kv_cache_dtype: torch.dtype,
) -> None:
    """Runs the most memory-hungry step the scheduler can build, against a scratch KV cache
    that is dropped afterwards; the outputs are garbage (zero pixels, token 0).

    * the vision tower on `max_encoder_tokens_per_step` tokens' worth of the largest
      frames (at least one frame; the scheduler runs a larger item alone);
    * one prompt of `max_num_batched_tokens` tokens (one sequence: the most attention
      work for the token budget), its first rows taken from the encoder output, kept
      alive as the encoder cache keeps it;
    * logits and the sampler's heaviest path for `max_num_seqs` rows;
    * a slice of prompt-logprobs scoring (engine/prompt_logprobs.py)."""
    mc: ModelConfig = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    encoded = None  # a text-only model (no image_config) runs no vision tower
    if image_config is not None:
        encoded = _run_largest_encoder_call(model, config, image_config, dtype, device)

    num_tokens = max(1, min(config.max_num_batched_tokens, max_model_len))
    num_blocks = -(-num_tokens // config.block_size)
    kv_caches = allocate_kv_caches(mc, num_blocks, config.block_size, kv_cache_dtype, device)
    metadata = AttentionMetadata(
        num_seqs=1,
        query_lens=[num_tokens],
        seq_lens=[num_tokens],
        query_start_loc=to_device([0, num_tokens], torch.int32, device),
        seq_lens_tensor=to_device([num_tokens], torch.int32, device),
        block_tables=to_device([list(range(num_blocks))], torch.int32, device),
        slot_mapping=torch.arange(num_tokens, dtype=torch.long, device=device),
        is_decode_only=False,
    )
    media_rows = 0 if encoded is None else min(encoded.shape[0], num_tokens)
    hidden = model.forward(
        torch.zeros(num_tokens, dtype=torch.long, device=device),
        torch.arange(num_tokens, device=device).expand(3, num_tokens).contiguous(),  # [3, T]
        kv_caches,
        metadata,
        None if encoded is None else encoded[:media_rows],
        None if encoded is None else torch.arange(media_rows, device=device),
    )  # [T, hidden]
    num_rows = min(config.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[-num_rows:])  # [S, vocab], cast by the sampler
    # A min_tokens ban and a grammar mask on every row too (the mask's [S, V] biases).
    allow_all = torch.full(((logits.shape[1] + 31) // 32,), -1, dtype=torch.int32)
    row = SamplingRow(heaviest_sampling(config.max_logprobs), [0] * num_tokens, [0],
                      banned_token_ids=(0,),
                      allowed_tokens=allow_all)  # fmt: skip
    rows = [row] * num_rows
    Sampler().sample(logits, rows).result()  # its own: the engine's draws stay untouched
    del logits
    # A prompt_logprobs request scores its prompt a slice of rows at a time: one slice's
    # logits and log-softmax, with the most alternatives the server allows.
    scored = hidden[:SLICE_ROWS]
    score_prompt_tokens("profile", scored, 0, [0] * (scored.shape[0] + 1), config.max_logprobs,
                        model.compute_logits).entries()  # fmt: skip


def _run_largest_encoder_call(
    model, config: EngineConfig, image_config: ImageProcessorConfig, dtype, device
) -> torch.Tensor:  # [num_frames * tokens_per_frame, hidden]
    vision = model.config.vision
    merge = vision.spatial_merge_size
    t, h, w = largest_frame_grid(image_config)
    tokens_per_frame = t * h * w // merge**2
    num_frames = max(1, config.max_encoder_tokens_per_step // tokens_per_frame)
    pixels = torch.zeros(num_frames * t * h * w, vision.patch_dim, dtype=dtype, device=device)
    grid = torch.tensor([[t, h, w]] * num_frames, dtype=torch.long)
    return model.encode_images(pixels, grid)


def profile_kv_cache_bytes(
    probe: CudaMemoryProbe,
    model,
    config: EngineConfig,
    *,
    max_model_len: int,
    kv_cache_dtype: torch.dtype,
    block_bytes: int,
) -> tuple[int, DeviceMemoryUse]:
    """Steps 2 and 3 of the module docstring, once the weights are loaded: the bytes the
    KV cache may take, and the readings they come from."""
    probe.reset_peak()
    image_config = None
    if model.config.vision is not None:
        image_config = ImageProcessorConfig.from_model_dir(config.model)
    try:
        run_largest_step(
            model, config, image_config, max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype
        )
    except torch.OutOfMemoryError as exc:
        raise MemoryBudgetError(
            "the largest step the settings allow does not fit in the device's memory beside "
            f"the weights (max_num_batched_tokens={config.max_num_batched_tokens}, "
            f"max_encoder_tokens_per_step={config.max_encoder_tokens_per_step}, "
            f"max_num_seqs={config.max_num_seqs}); lower them"
        ) from exc
    use = probe.read()
    probe.release_cached()
    dtype = next(model.parameters()).dtype
    reserved = encoder_cache_bytes(model.config, config, dtype)
    return kv_cache_bytes(use, config.gpu_memory_utilization, block_bytes, reserved), use


def log_sizing(num_blocks: int, block_bytes: int, block_size: int, source: str) -> None:
    logger.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens), %s",
        num_blocks,
        block_size,
        (num_blocks + 1) * block_bytes / GIB,
        num_blocks * block_size,
        source,
    )
