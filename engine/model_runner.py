"""Owns the model, the KV cache tensors and the encoder outputs; runs one step.

`launch(SchedulerOutput)` queues a step's device work and returns at once:
    1. drop evicted encoder outputs; encode this step's new media in ONE batched
       call across requests, split the rows per item, store them by content hash
       (engine/media_encoding.py);
    2. gather the flat batch on the host (engine/step_inputs.py) and move it to the
       device without stalling (engine/device_io.py);
    3. forward (a CUDA graph replay for decode steps on a GPU, engine/cuda_graphs.py),
       logits of the last row of every sequence that samples, sample.
`PendingStep.result()` (engine/runner_output.py) then waits for the sampled tokens: the
step's one host sync.
`execute` is both at once. A media item that fails to encode fails only the requests
that need it.

With `tensor_parallel_size` N > 1 this is rank 0: it starts ranks 1..N-1
(engine/shard_worker.py), holds its 1/N of the decoder layers and of the KV cache, and
the model sends the workers every forward's inputs (engine/tensor_parallel.py).

KV caches hold `num_kv_blocks + 1` blocks: the last is the scratch block that padding
rows of CUDA-graph steps write into; the scheduler never hands it out.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.attention import check_attention_backend, get_attention_backend
from engine.attention.base import AttentionMetadata, AttentionShape
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphRunner, DecodeInputs, graph_max_seq_len
from engine.device_config import (
    check_tensor_parallel_device,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from engine.device_io import DeviceTimer, to_device
from engine.encoder_cache import EncoderCache
from engine.errors import ModelLoadError
from engine.kv_cache_sizing import (
    CPU_KV_CACHE_GIB,
    GIB,
    CudaMemoryProbe,
    allocate_kv_caches,
    blocks_in,
    check_free_at_start,
    kv_block_bytes,
    log_sizing,
    profile_kv_cache_bytes,
)
from engine.media_encoding import encode_into_cache, encode_media, media_failure
from engine.model_config import ModelConfig, check_max_model_len
from engine.models import moe
from engine.models.cpu_prepack import can_prepack, prepack_linears
from engine.models.loader import load_model
from engine.models.small_batch_linear import use_small_batch_linears
from engine.penalties import in_flight_outputs
from engine.prompt_logprobs import PendingPromptLogprobs, score_prompt_tokens, scored_positions
from engine.protocol import ErrorInfo
from engine.request import MediaItem
from engine.runner_output import ModelRunnerOutput, PendingStep
from engine.sampler import PendingSample, Sampler, SamplingRow, leaves_no_token
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from engine.shard_worker import ShardWorkers
from engine.step_inputs import InFlightTokens, StepInputs, gather_step_inputs
from engine.token_bans import banned_token_ids, no_token_left

logger = logging.getLogger(__name__)


class ModelRunner:
    """Loads the model and KV cache for one `EngineConfig` and executes scheduler steps."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        model_config = ModelConfig.from_model_dir(config.model)
        if not (Path(config.model) / "tokenizer.json").is_file():
            # Checked before the weights load: the server found it missing only after the
            # engine was ready, and failed with a traceback.
            raise ModelLoadError(
                f"no tokenizer.json in model folder {Path(config.model).name!r} (the server "
                "and structured outputs read the tokenizer from it)"
            )
        self.dtype = resolve_dtype(config.dtype, self.device, model_config.torch_dtype)
        check_attention_backend(config.attention_backend, self.device, self.dtype)
        if config.num_threads:  # the engine process's default: engine/process.py
            torch.set_num_threads(config.num_threads)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, config.kv_cache_scale
        )
        self.shard_workers: ShardWorkers | None = None
        if config.tensor_parallel_size > 1:
            model_config = model_config.shard(config.tensor_parallel_size)  # fail before forking
            self.shard_workers = self._start_shard_workers()
        try:
            self._load(model_config)
        except BaseException:
            self.close()
            raise

    def _load(self, model_config: ModelConfig) -> None:
        """The model (this rank's shard of it), the KV cache, the encoder cache, the
        sampler and, on a GPU, the decode graphs."""
        config = self.config
        self.attention = get_attention_backend(
            config.attention_backend,
            AttentionShape.of_model(
                model_config, config.block_size, self.dtype, self.kv_cache_dtype
            ),
            config.kv_cache_scale,
            config.kv_cache_scale,
            max_graph_batch=config.max_graph_batch,
        )
        memory_probe = None
        if self.device.type == "cuda" and self._sizes_kv_cache_from_memory():
            memory_probe = CudaMemoryProbe(self.device)  # before the weights load
            check_free_at_start(
                memory_probe.total, memory_probe.used_at_start, config.gpu_memory_utilization
            )
        self.model = load_model(
            config.model,
            dtype=self.dtype,
            device=self.device,
            attention=self.attention,
            tensor_parallel=None if self.shard_workers is None else self.shard_workers.group,
        )
        if can_prepack(self.device, self.dtype):
            prepack_linears(self.model)
        if config.small_batch_linear_rows and self.device.type == "cuda":
            use_small_batch_linears(self.model.model, config.small_batch_linear_rows)
        self.model_config = self.model.config
        self.max_model_len = check_max_model_len(config.max_model_len, self.model_config)
        if self.model_config.sliding_window == self.max_model_len != config.max_model_len:
            logger.warning(
                "the model's layers use a sliding window of %d tokens, which Tessera does "
                "not implement: its context length is capped to the window",
                self.max_model_len,
            )
        self.block_size = config.block_size
        self.num_kv_blocks = self._num_kv_blocks(memory_probe)
        capacity = self.num_kv_blocks * self.block_size
        if capacity < self.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len=%d: a request's "
                "default max_tokens is held to the cache's room and one that asks for more "
                "is refused; lower --max-model-len or give the cache more memory "
                "(--gpu-memory-utilization, --kv-cache-memory-gib)",
                capacity,
                self.max_model_len,
            )
        self.kv_caches = allocate_kv_caches(  # per layer [N + 1, 2, B, Hkv, D]
            self.model_config,
            self.num_kv_blocks + 1,
            self.block_size,
            self.kv_cache_dtype,
            self.device,
        )
        if self.shard_workers is not None:
            self.shard_workers.setup(self.num_kv_blocks)
        self.encoder_cache = EncoderCache()
        self.sampler = Sampler(config.seed)
        self.decode_graphs: DecodeGraphRunner | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            if moe.runs_without_sync(self.model, self.dtype, self.device):
                self.enable_decode_graphs(use_cuda_graphs=True)
            else:
                logger.info(
                    "decode steps run eagerly: the mixture-of-experts layers need a host "
                    "sync here (engine/models/moe.py)"
                )

    def _start_shard_workers(self) -> ShardWorkers:
        """Starts tensor-parallel ranks 1..N-1 and joins the group with them (rank 0)."""
        check_tensor_parallel_device(self.config.tensor_parallel_size, self.device)
        return ShardWorkers(self.config, self.dtype, self.kv_cache_dtype, self.device)

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any. The runner cannot step after this."""
        if self.shard_workers is not None:
            self.shard_workers.close()
            self.shard_workers = None

    def enable_decode_graphs(self, *, use_cuda_graphs: bool) -> None:
        """Captures the decode graphs (`use_cuda_graphs=False`: runs the same padded,
        static-buffer path eagerly; for tests on CPU)."""
        if self.shard_workers is not None:
            raise ValueError("decode graphs do not capture tensor-parallel collectives yet")
        graphs = DecodeGraphRunner(
            self.model,
            self.kv_caches,
            self.attention,
            max_batch_size=self.config.max_graph_batch,
            max_seq_len=graph_max_seq_len(
                self.config.cuda_graph_max_seq_len,
                self.config.attention_backend,
                self.max_model_len,
            ),
            block_size=self.block_size,
            scratch_block=self.num_kv_blocks,
            use_cuda_graphs=use_cuda_graphs,
        )
        with torch.inference_mode():
            graphs.capture()
        self.decode_graphs = graphs

    def _sizes_kv_cache_from_memory(self) -> bool:
        return self.config.num_kv_blocks is None and self.config.kv_cache_memory_gib is None

    def _num_kv_blocks(self, memory_probe: CudaMemoryProbe | None) -> int:
        """Blocks for the scheduler (engine/kv_cache_sizing.py); the memory also pays for
        the scratch block."""
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        block_bytes = kv_block_bytes(self.model_config, self.block_size, self.kv_cache_dtype)
        # More than every sequence at full length can never be used.
        useful = -(-config.max_num_seqs * self.max_model_len // self.block_size)
        if memory_probe is None:
            gib = config.kv_cache_memory_gib or CPU_KV_CACHE_GIB
            num_blocks = blocks_in(int(gib * GIB), block_bytes, useful)
            source = f"from {gib} GiB"
            if num_blocks == useful:  # said, or "0.50 GiB ... from 2.0 GiB" looked wrong (fuzz86)
                source += ", capped at max_num_seqs x max_model_len tokens, all that can be used"
            log_sizing(num_blocks, block_bytes, self.block_size, source)
            return num_blocks
        num_bytes, use = profile_kv_cache_bytes(
            memory_probe,
            self.model,
            config,
            max_model_len=self.max_model_len,
            kv_cache_dtype=self.kv_cache_dtype,
            block_bytes=block_bytes,
        )
        num_blocks = blocks_in(num_bytes, block_bytes, useful)
        log_sizing(
            num_blocks,
            block_bytes,
            self.block_size,
            f"from gpu_memory_utilization={config.gpu_memory_utilization} of "
            f"{use.total / GIB:.1f} GiB (weights + largest step {use.torch_peak / GIB:.2f} GiB, "
            f"other CUDA allocations {use.non_torch / GIB:.2f} GiB)",
        )
        return num_blocks

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(
        self, scheduler_output: SchedulerOutput, previous: PendingStep | None = None
    ) -> PendingStep:
        """Queues the step's device work; the host does not wait for any of it.

        With overlap scheduling `previous` is the step still in flight: rows whose token
        it is sampling take that token on the device."""
        self.encoder_cache.drop(scheduler_output.evicted_encoder_hashes)
        encoder_timer = None
        if scheduler_output.media_to_encode:
            encoder_timer = DeviceTimer(self.device)
            encoder_timer.start()
        failed_hashes, num_batches = encode_media(
            scheduler_output.media_to_encode,
            self._encode_batch,
            self.encoder_cache,
            self.dtype,
            self.device,
        )
        if encoder_timer is not None:
            encoder_timer.stop()
        errors: dict[str, ErrorInfo] = {}
        chunks = []
        for chunk in scheduler_output.chunks:
            failure = media_failure(chunk, failed_hashes, self.encoder_cache)
            if failure is not None:
                errors[chunk.request.request_id] = failure
            else:
                chunks.append(chunk)
        sample, request_ids, prompt_logprobs = None, [], []
        if chunks:
            sample, request_ids, prompt_logprobs, stuck = self._run(chunks, previous)
            errors.update(stuck)  # failed at the update, without the token drawn for them
        return PendingStep(
            sample,
            request_ids,
            errors,
            encoder_timer,
            len(scheduler_output.media_to_encode),
            num_batches,
            prompt_logprobs,
        )

    def _encode_batch(self, items: list[MediaItem]) -> None:
        """One vision-encoder call; the rows go to the encoder cache."""
        encode_into_cache(self.model, items, self.encoder_cache, self.dtype, self.device)

    def _run(
        self, chunks: list[ScheduledChunk], previous: PendingStep | None
    ) -> tuple[PendingSample | None, list[str], list[PendingPromptLogprobs], dict[str, ErrorInfo]]:
        inputs = gather_step_inputs(chunks, self.block_size, self.encoder_cache)
        in_flight = self._in_flight_tokens(inputs, previous)
        hidden = self._forward(inputs, in_flight)  # [T, hidden]
        prompt_logprobs = self._score_prompts(chunks, inputs, hidden)
        sampling = [(row, chunk) for row, chunk in enumerate(chunks) if chunk.samples]
        if not sampling:
            return None, [], prompt_logprobs, {}
        if len(sampling) == inputs.num_tokens:  # every row is the last of a sampling sequence
            last_hidden = hidden[: len(sampling)]  # [S, hidden]
        else:
            query_ends = inputs.query_ends
            last_rows = to_device([query_ends[row] - 1 for row, _ in sampling], torch.long,
                                  self.device)  # fmt: skip
            last_hidden = hidden.index_select(0, last_rows)  # [S, hidden]
        logits = self.model.compute_logits(last_hidden)  # [S, vocab], the model's dtype
        rows = [
            SamplingRow(
                chunk.request.sampling,
                chunk.request.prompt_token_ids,  # the penalties read the sampler's table
                chunk.request.output_token_ids,  # (engine/held_tokens.py) instead
                chunk.request.generator_on(self.device),
                banned_token_ids(chunk),
                chunk.request.allowed_tokens(),
                chunk.request,
            )
            for _, chunk in sampling
        ]
        request_ids = [c.request.request_id for _, c in sampling]
        vocab = logits.shape[1]
        stuck = {
            row.request.request_id: no_token_left(row.request)
            for row in rows
            if leaves_no_token(row.allowed_tokens, row.banned_token_ids, vocab)
        }
        outputs_in_flight = in_flight_outputs(sampling, inputs, in_flight, self.device)
        sample = self.sampler.sample(logits, rows, outputs_in_flight)
        return sample, request_ids, prompt_logprobs, stuck

    def _score_prompts(
        self, chunks: list[ScheduledChunk], inputs: StepInputs, hidden: torch.Tensor
    ) -> list[PendingPromptLogprobs]:
        """The prompt logprobs of every chunk whose request asks for them."""
        scored = []
        for chunk, end_row in zip(chunks, inputs.query_ends, strict=True):
            request = chunk.request
            num_top = request.sampling.prompt_logprobs
            if num_top is None:
                continue
            positions = scored_positions(chunk.start, chunk.end, request.num_prompt_tokens,
                                         len(request.prompt_logprobs))  # fmt: skip
            if not positions:
                continue
            first_row = end_row - chunk.num_tokens + positions.start - chunk.start
            rows = hidden[first_row : first_row + len(positions)]  # [n, hidden]
            scored.append(score_prompt_tokens(request.request_id, rows, positions.start,
                                              request.prompt_token_ids, num_top,
                                              self.model.compute_logits))  # fmt: skip
        return scored

    def _in_flight_tokens(
        self, inputs: StepInputs, previous: PendingStep | None
    ) -> InFlightTokens | None:
        if not inputs.pending_rows:
            return None
        if previous is None or previous.sample is None:
            raise RuntimeError("a row's token is in flight but no step is sampling it")
        source_row = {
            request_id: row for row, request_id in enumerate(previous.sampled_request_ids)
        }
        sources = [source_row[request_id] for request_id in inputs.pending_request_ids]
        rows_and_sources = to_device([inputs.pending_rows, sources], torch.long, self.device)
        token_ids = previous.sample.token_ids.index_select(0, rows_and_sources[1])  # [P]
        return InFlightTokens(rows_and_sources[0], token_ids)

    def _forward(
        self, inputs: StepInputs, in_flight: InFlightTokens | None
    ) -> torch.Tensor:  # [T, hidden]
        graphs = self.decode_graphs
        if (
            graphs is not None
            and inputs.is_decode_only
            and not inputs.multimodal_rows
            and graphs.can_run(len(inputs.seq_lens), max(inputs.seq_lens))
        ):
            return graphs.run(
                DecodeInputs(
                    inputs.input_ids,
                    inputs.positions,
                    inputs.slot_mapping,
                    inputs.block_tables,
                    inputs.seq_lens,
                    in_flight,
                )
            )
        device = self.device
        width = max(len(ids) for ids in inputs.block_tables)
        block_tables = [ids + [0] * (width - len(ids)) for ids in inputs.block_tables]
        metadata = AttentionMetadata(
            num_seqs=len(inputs.query_lens),
            query_lens=inputs.query_lens,
            seq_lens=inputs.seq_lens,
            query_start_loc=to_device([0, *inputs.query_ends], torch.int32, device),
            seq_lens_tensor=to_device(inputs.seq_lens, torch.int32, device),
            block_tables=to_device(block_tables, torch.int32, device),  # [S, max_blocks]
            slot_mapping=to_device(inputs.slot_mapping, torch.long, device),
            is_decode_only=inputs.is_decode_only,
        )
        multimodal_embeds = multimodal_rows = None
        if inputs.multimodal_rows:
            multimodal_embeds = torch.cat(inputs.multimodal_embeds)  # [M, hidden]
            multimodal_rows = to_device(inputs.multimodal_rows, torch.long, device)  # [M]
        input_ids = to_device(inputs.input_ids, torch.long, device)  # [T]
        if in_flight is not None:
            in_flight.write_into(input_ids)
        return self.model.forward(
            input_ids,
            to_device(inputs.positions, torch.long, device),  # [3, T]
            self.kv_caches,
            metadata,
            multimodal_embeds,
            multimodal_rows,
        )
