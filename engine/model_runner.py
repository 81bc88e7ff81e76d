"""Owns the model, the KV cache tensors and the encoder outputs; runs one step.

`execute(SchedulerOutput)`:
    1. drop evicted encoder outputs; encode this step's new media in ONE batched
       call across requests, split the rows per item, store them by content hash;
    2. build the flat batch: token ids, M-RoPE positions [3, T], slot mapping,
       block tables, query start locations, and the encoder rows each chunk covers;
    3. forward, logits of the last row of every sequence that samples, sample.
A media item that fails to encode fails only the requests that need it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.attention import get_attention_backend
from engine.attention.base import AttentionMetadata
from engine.config import EngineConfig
from engine.encoder_cache import EncoderCache
from engine.errors import MediaError, TesseraError
from engine.model_config import ModelConfig
from engine.models.cpu_prepack import can_prepack, prepack_linears
from engine.models.loader import load_model
from engine.protocol import ErrorInfo, TokenLogprob
from engine.request import MediaItem
from engine.sampler import Sampler, SamplingRow
from engine.scheduler import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob]
    errors: dict[str, ErrorInfo] = field(default_factory=dict)
    encoder_seconds: float = 0.0
    num_encoder_items: int = 0
    num_encoder_batches: int = 0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(
    name: str, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on CPU bfloat16 only for a bfloat16 checkpoint on a CPU
    with native bf16 matmuls (AVX512-BF16 / AMX: about 2x float32 there), else float32."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if checkpoint_dtype == "bfloat16" and cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, scale: float) -> torch.dtype:
    """`auto`: the model dtype; `fp8`: float8_e4m3fn storing `x / scale` (1 byte/element)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"kv_cache_scale must be a positive finite number, got {scale}")
    return model_dtype if name == "auto" else torch.float8_e4m3fn


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (False where it cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def error_info(exc: Exception) -> ErrorInfo:
    if isinstance(exc, TesseraError):
        return ErrorInfo(
            exc.message, type=exc.type, code=exc.code, param=exc.param, status=exc.status
        )
    return ErrorInfo("internal error while running the model", type="internal_error", status=500)


class ModelRunner:
    """Loads the model and KV cache for one `EngineConfig` and executes scheduler steps."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        checkpoint_dtype = ModelConfig.from_model_dir(config.model).torch_dtype
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, config.kv_cache_scale
        )
        attention = get_attention_backend(
            config.attention_backend, config.kv_cache_scale, config.kv_cache_scale
        )
        self.model = load_model(
            config.model, dtype=self.dtype, device=self.device, attention=attention
        )
        if can_prepack(self.device, self.dtype):
            prepack_linears(self.model)
        self.model_config = self.model.config
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.block_size = config.block_size
        self.num_kv_blocks = self._num_kv_blocks()
        mc = self.model_config
        shape = (self.num_kv_blocks, 2, self.block_size, mc.num_key_value_heads, mc.head_dim)
        # Zeros, not empty: a backend may gather whole blocks and mask the tail, and
        # masked garbage (NaN/inf) would still poison the weighted sum.
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)  # [N, 2, B, Hkv, D]
            for _ in range(mc.num_hidden_layers)
        ]
        self.encoder_cache = EncoderCache()
        self.sampler = Sampler(config.seed)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        mc = self.model_config
        dtype_bytes = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        block_bytes = (
            2
            * self.block_size
            * mc.num_key_value_heads
            * mc.head_dim
            * dtype_bytes
            * mc.num_hidden_layers
        )
        by_memory = int(self.config.kv_cache_memory_gib * 2**30) // block_bytes
        # More than every sequence at full length can never be used.
        useful = -(-self.config.max_num_seqs * self.max_model_len // self.block_size)
        return max(1, min(by_memory, useful))

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.encoder_cache.drop(scheduler_output.evicted_encoder_hashes)
        start = time.perf_counter()
        failed_hashes, num_batches = self._encode(scheduler_output.media_to_encode)
        encoder_seconds = time.perf_counter() - start if scheduler_output.media_to_encode else 0.0
        errors: dict[str, ErrorInfo] = {}
        chunks = []
        for chunk in scheduler_output.chunks:
            needed = chunk.request.media_overlapping(chunk.start, chunk.end)
            failure = next(
                (failed_hashes[m.content_hash] for m in needed if m.content_hash in failed_hashes),
                None,
            )
            if failure is None:
                missing = next(
                    (m for m in needed if m.content_hash not in self.encoder_cache), None
                )
                if missing is not None:
                    failure = error_info(
                        MediaError(
                            f"{missing.modality} at {missing.offset} "
                            "has no pixels and no cached encoding"
                        )
                    )
            if failure is not None:
                errors[chunk.request.request_id] = failure
            else:
                chunks.append(chunk)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        if chunks:
            sampled, logprobs = self._run(chunks)
        return ModelRunnerOutput(
            sampled,
            logprobs,
            errors,
            encoder_seconds,
            len(scheduler_output.media_to_encode),
            num_batches,
        )

    def _encode(self, items: list[MediaItem]) -> tuple[dict[str, ErrorInfo], int]:
        """Encodes `items` in one batched call (per item on failure, to find the culprit)."""
        if not items:
            return {}, 0
        failed: dict[str, ErrorInfo] = {}
        ready = []
        for item in items:
            if item.embeds is not None:  # fetched features: the "encoder" is the request's copy
                self.encoder_cache.put(
                    item.content_hash, item.embeds.to(device=self.device, dtype=self.dtype)
                )  # [num_tokens, hidden]
            elif item.pixel_values is None:
                failed[item.content_hash] = error_info(
                    MediaError(
                        f"{item.modality} at {item.offset} has no pixels and no cached encoding"
                    )
                )
            else:
                ready.append(item)
        if not ready:
            return failed, 0
        try:
            self._encode_batch(ready)
            return failed, 1
        except Exception as exc:  # noqa: BLE001 - retried per item to attribute the failure
            if len(ready) == 1:
                logger.info("encoding %s failed: %s", ready[0].content_hash, exc)
                failed[ready[0].content_hash] = error_info(exc)
                return failed, 1
        for item in ready:
            try:
                self._encode_batch([item])
            except Exception as exc:  # noqa: BLE001
                logger.info("encoding %s failed: %s", item.content_hash, exc)
                failed[item.content_hash] = error_info(exc)
        return failed, 1 + len(ready)

    def _encode_batch(self, items: list[MediaItem]) -> None:
        pixel_values = torch.cat([item.pixel_values for item in items]).to(
            device=self.device, dtype=self.dtype
        )  # [P, C * T_patch * patch * patch]
        grid_thw = torch.tensor(
            [item.grid_thw for item in items], dtype=torch.long, device=self.device
        )  # [N, 3]
        rows = self.model.encode_images(pixel_values, grid_thw)  # [sum tokens, hidden]
        merge = self.model_config.vision.spatial_merge_size
        counts = [t * h * w // merge**2 for t, h, w in (item.grid_thw for item in items)]
        if rows.shape[0] != sum(counts):
            raise MediaError(
                f"the vision encoder returned {rows.shape[0]} rows for "
                f"{sum(counts)} expected tokens"
            )
        for item, count in zip(items, counts, strict=True):
            if count != item.num_tokens:
                raise MediaError(
                    f"{item.modality} at {item.offset} has {item.num_tokens} "
                    f"placeholders but its encoding has {count} rows"
                )
        for item, item_rows in zip(items, rows.split(counts), strict=True):
            self.encoder_cache.put(item.content_hash, item_rows)

    def _run(self, chunks: list[ScheduledChunk]) -> tuple[dict[str, int], dict[str, TokenLogprob]]:
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []  # each [3, n]: prompt slices
        decode_rows: list[int] = []  # flat positions of tokens past the prompt (same in 3 rows)
        decode_values: list[int] = []
        slot_mapping: list[int] = []
        embeds: list[torch.Tensor] = []  # each [rows, hidden]
        mask_rows: list[int] = []
        query_lens, seq_lens = [], []
        size = self.block_size
        for chunk in chunks:
            request = chunk.request
            base = len(input_ids)
            input_ids += request.token_ids_between(chunk.start, chunk.end)
            num_prompt = request.num_prompt_tokens
            if chunk.start < num_prompt:
                prompt_end = min(chunk.end, num_prompt)
                positions.append((base, request.positions[:, chunk.start : prompt_end]))
            for index in range(max(chunk.start, num_prompt), chunk.end):
                decode_rows.append(base + index - chunk.start)
                decode_values.append(index + request.rope_delta)
            block_ids = request.block_ids
            slot_mapping += [
                block_ids[i // size] * size + i % size for i in range(chunk.start, chunk.end)
            ]
            for media in request.media_overlapping(chunk.start, chunk.end):
                lo, hi = max(chunk.start, media.offset), min(chunk.end, media.end)
                rows = self.encoder_cache.get(media.content_hash)
                embeds.append(rows[lo - media.offset : hi - media.offset])
                mask_rows.extend(range(base + lo - chunk.start, base + hi - chunk.start))
            query_lens.append(chunk.num_tokens)
            seq_lens.append(chunk.end)
        device = self.device
        num_tokens = len(input_ids)
        width = max(len(chunk.request.block_ids) for chunk in chunks)
        block_tables = torch.tensor(
            [ids + [0] * (width - len(ids)) for ids in (c.request.block_ids for c in chunks)],
            dtype=torch.int32,
        )  # [S, max_blocks]
        query_ends = list(itertools.accumulate(query_lens))  # host copy of query_start_loc[1:]
        query_start_loc = torch.tensor([0, *query_ends], dtype=torch.int32)  # [S + 1]
        metadata = AttentionMetadata(
            num_seqs=len(chunks),
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc.to(device),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32).to(device),
            block_tables=block_tables.to(device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long).to(device),
            is_decode_only=all(n == 1 for n in query_lens),
        )
        multimodal_embeds = multimodal_mask = None
        if embeds:
            multimodal_embeds = torch.cat(embeds)  # [M, hidden]
            multimodal_mask = torch.zeros(num_tokens, dtype=torch.bool)
            multimodal_mask[mask_rows] = True
            multimodal_mask = multimodal_mask.to(device)  # [T]
        hidden = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long).to(device),  # [T]
            self._flat_positions(num_tokens, positions, decode_rows, decode_values).to(device),
            self.kv_caches,
            metadata,
            multimodal_embeds,
            multimodal_mask,
        )  # [T, hidden]
        sampling = [(row, chunk) for row, chunk in enumerate(chunks) if chunk.samples]
        if not sampling:
            return {}, {}
        if len(sampling) == num_tokens:  # every row is the last of a sampling sequence
            last_hidden = hidden  # [S, hidden]
        else:
            last_rows = torch.tensor([query_ends[row] - 1 for row, _ in sampling], device=device)
            last_hidden = hidden.index_select(0, last_rows)  # [S, hidden]
        logits = self.model.compute_logits(last_hidden)  # [S, vocab] float32
        rows = [
            SamplingRow(
                chunk.request.sampling,
                chunk.request.prompt_token_ids,
                chunk.request.output_token_ids,
                chunk.request.generator,
            )
            for _, chunk in sampling
        ]
        result = self.sampler(logits, rows)
        sampled, logprobs = {}, {}
        for (_, chunk), token_id, token_logprob in zip(
            sampling, result.token_ids, result.logprobs, strict=True
        ):
            sampled[chunk.request.request_id] = token_id
            if token_logprob is not None:
                logprobs[chunk.request.request_id] = token_logprob
        return sampled, logprobs

    @staticmethod
    def _flat_positions(
        num_tokens: int,
        prompt_slices: list[tuple[int, torch.Tensor]],
        decode_rows: list[int],
        decode_values: list[int],
    ) -> torch.Tensor:  # [3, T] int64
        """Prompt tokens take their precomputed M-RoPE positions; later tokens sit at
        `index + rope_delta` in all three rows."""
        positions = torch.empty(3, num_tokens, dtype=torch.long)
        for base, piece in prompt_slices:  # piece [3, n]
            positions[:, base : base + piece.shape[1]] = piece
        if decode_rows:
            positions[:, decode_rows] = torch.tensor(decode_values, dtype=torch.long)
        return positions
