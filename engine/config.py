"""Engine configuration: one frozen dataclass, resolved once at start-up.

CLI flags, `TESSERA_*` environment variables and YAML files (configs/) map
one-to-one onto these fields (see `server/settings.py`). What the engine learns
at start-up (number of KV blocks, the model's context length) goes into a new
resolved config via `dataclasses.replace`, never mutated in place.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine.protocol import DEFAULT_MAX_LOGPROBS

SCHEDULING_POLICIES = ("fcfs", "priority")
# The names each setting takes, checked with the settings (a wrong one failed only in the
# engine process, with a traceback and the exit code that asks a supervisor to restart).
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names
KV_CACHE_DTYPES = ("auto", "fp8")
ATTENTION_BACKENDS = ("torch", "flashinfer")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
MAX_BLOCK_SIZE = 256  # tokens per KV block (vLLM's largest choice is 128)
# torch intra-op threads: more than any host's cores, and far below the thousands at which
# thread creation fails and aborts the engine without naming the setting.
MAX_NUM_THREADS = 1024
SMALL_BATCH_LINEAR_MAX_ROWS = 8  # the kernel's MAX_ROWS (kernels/triton/small_batch_linear.py)


@dataclass(frozen=True)
class EngineConfig:
    model: str  # local Hugging Face checkpoint folder
    served_model_name: str | None = None  # defaults to the folder name
    dtype: str = "auto"  # auto = bfloat16 on CUDA, and on a CPU with native bf16 for a bf16 checkpoint; else float32
    device: str = "auto"  # auto = cuda if available else cpu
    max_model_len: int | None = None  # None = the model's max_position_embeddings (or its sliding window, if shorter: Tessera attends to the whole context)
    max_num_seqs: int = 64  # most sequences running at once (continuous batching)
    max_num_batched_tokens: int = 2048  # token budget of one engine step (prefill chunks + decodes)
    scheduling_policy: str = "fcfs"  # fcfs = arrival order; priority = by each request's priority (lower first), and a more urgent arrival preempts a less urgent running request
    block_size: int = 16  # tokens per KV-cache block (at most 256)
    kv_cache_memory_gib: float | None = None  # KV cache size; None = sized from gpu_memory_utilization on CUDA, 2 GiB on CPU
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device's memory for weights, activations and the KV cache
    kv_cache_dtype: str = "auto"  # auto = the model dtype; fp8 = float8_e4m3fn, 1 byte/element
    kv_cache_scale: float = 1.0  # fp8 only: static K and V scale (stores x / scale, max 448)
    num_kv_blocks: int | None = None  # exact block count, over the two above (tests force preemption)
    enable_prefix_caching: bool = True  # reuse KV blocks of equal text + media prefixes
    encoder_cache_tokens: int = 16384  # vision-encoder output rows kept for reuse
    max_encoder_tokens_per_step: int = 16384  # bounds vision-encoder work per step
    split_media: bool = True  # False = a prefill chunk never ends inside a media span
    attention_backend: str = "torch"  # "torch" (reference, CPU/GPU) or "flashinfer" (GPU)
    enforce_eager: bool = False  # never replay decode steps from CUDA graphs (GPU only)
    overlap_scheduling: bool = True  # GPU: launch step N+1 before reading step N's tokens
    cuda_graph_max_batch_size: int | None = None  # largest captured decode batch; None = max_num_seqs
    small_batch_linear_rows: int = 0  # CUDA: the decoder's linear layers take the Triton matrix-vector kernel for up to this many rows (at most 8), cuBLAS above; 0 = cuBLAS always (docs/gpu.md)
    cuda_graph_max_seq_len: int | None = None  # decode steps with a longer history run eagerly; None = the whole context with flashinfer (its cost does not grow with the bound), 8192 with torch (which pads keys to it)
    num_threads: int | None = None  # torch intra-op threads of the engine (per rank, at most 1024); None = torch's default on a CPU, 1 in the server's engine process with a GPU (its host tensor work is small, and parallel regions stall while the API processes and image decoding keep the cores busy); an in-process LLM keeps its caller's setting
    tensor_parallel_size: int = 1  # ranks the decoder layers are split over (CPU, gloo); each rank is a process
    seed: int = 0  # engine-wide sampling seed for requests without their own
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # the most alternatives a request may ask for per token (logprobs, top_logprobs, prompt_logprobs), as vLLM's --max-logprobs; each costs a top-k over the vocabulary and a detokenised entry in every chunk
    grammar_cache_size: int = 128  # structured outputs: compiled grammars kept, so a repeated schema is not compiled again; 0 = none
    grammar_lexer_fuel: int = 100_000  # structured outputs: regex work one grammar may cost (~50k per ms) before it fails its request; llguidance's default is 1,000,000
    feature_fetch_parallel: int = 8  # concurrent feature downloads per request (at most feature_fetch_max_connections); 1 = serial
    feature_fetch_timeout_s: float = 30.0  # deadline per feature URL, retries included, once it holds a connection (feature_fetch_max_connections); the wait for one has a deadline as long
    max_feature_bytes: int = 256 * 1024 * 1024  # per feature file
    feature_fetch_retries: int = 3  # transient failures (timeouts, 5xx, throttling)
    feature_fetch_max_connections: int = 64  # open feature downloads of all requests together, per storage kind (S3, http(s)); each request takes up to feature_fetch_parallel
    feature_fetch_max_bytes_in_flight: int = 2 * 1024**3  # bytes of feature downloads held at once, all requests together, from the body's first byte until the file is checked (host memory peaks near twice this: the bytes and their tensors); a download waits for room with its deadline paused, up to feature_fetch_timeout_s (then 503 feature_saturated); a file over it takes it whole
    feature_known_versions: int = 16384  # feature URLs whose version (ETag / Last-Modified) is remembered, so that an unchanged file is not downloaded again (least recently used forgotten first)
    s3_endpoint_url: str | None = None  # None = the standard AWS environment / config
    allow_private_feature_urls: bool = False  # allow http(s) feature URLs on private networks
    allowed_feature_url_prefixes: str | None = None  # comma-separated URL prefixes (http://, https://, s3://, each ending in '/', else https://a.example would also let https://a.example.evil.net in; or data:); a URL, and every redirect it takes, is held to them as it will be fetched (dot segments resolved); None = any
    engine_step_timeout_s: float = 300.0  # a pass of the engine loop (one step) longer than this is a hang: the engine exits, and the server with it, for its supervisor to restart; 0 = never
    api_server_stall_timeout_s: float = 30.0  # with api_server_count > 1: an API process whose output queue stays full this long (it reads none of its outputs: stopped, wedged, dead) has its requests aborted; the others' are never held up by it

    def __post_init__(self) -> None:
        if self.model.startswith("~"):  # from YAML or an env file, where no shell expands it
            object.__setattr__(self, "model", os.path.expanduser(self.model))
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        # Zero or less left every request waiting forever (nothing could be scheduled), or
        # failed inside the engine with a ZeroDivisionError; others failed only after the
        # model had loaded (minutes on a GPU), or were taken as given.
        check_ranges(
            self,
            positive=("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len",
                      "kv_cache_memory_gib", "kv_cache_scale", "num_kv_blocks",
                      "encoder_cache_tokens", "max_encoder_tokens_per_step",
                      "cuda_graph_max_batch_size", "cuda_graph_max_seq_len", "num_threads",
                      "feature_fetch_parallel", "feature_fetch_timeout_s", "max_feature_bytes",
                      "feature_fetch_max_connections", "feature_fetch_max_bytes_in_flight",
                      "feature_known_versions",
                      "grammar_lexer_fuel", "api_server_stall_timeout_s"),
            non_negative=("feature_fetch_retries", "grammar_cache_size", "max_logprobs"),
        )  # fmt: skip
        if self.block_size > MAX_BLOCK_SIZE:  # one block took the whole KV budget and more
            raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE}, got {self.block_size}")
        if (self.num_threads or 0) > MAX_NUM_THREADS:
            raise ValueError(
                f"num_threads must be at most {MAX_NUM_THREADS}, got {self.num_threads}"
            )
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name, choices in (("scheduling_policy", SCHEDULING_POLICIES),
                              ("dtype", DTYPE_NAMES), ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("attention_backend", ATTENTION_BACKENDS)):  # fmt: skip
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        seed_is_int = isinstance(self.seed, int) and not isinstance(self.seed, bool)
        if not seed_is_int or not -(2**63) <= self.seed < 2**64:  # manual_seed's range
            # (past it, every sampled step failed at its first draw, with the step's other
            # requests, greedy ones included)
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        if not 0 <= self.small_batch_linear_rows <= SMALL_BATCH_LINEAR_MAX_ROWS:
            raise ValueError(
                f"small_batch_linear_rows must be in [0, {SMALL_BATCH_LINEAR_MAX_ROWS}], "
                f"got {self.small_batch_linear_rows}"
            )
        if self.allowed_feature_url_prefixes is not None:
            check_url_prefixes(self.allowed_feature_url_prefixes)
        # An idle engine goes round its loop every IDLE_POLL_MS (500 ms): a shorter timeout
        # would end an engine that is only waiting.
        if not (self.engine_step_timeout_s == 0 or self.engine_step_timeout_s >= 1):
            raise ValueError(
                f"engine_step_timeout_s must be 0 (never) or at least 1, "
                f"got {self.engine_step_timeout_s}"
            )

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def max_graph_batch(self) -> int:
        """The largest decode batch a CUDA graph captures: 0 under enforce_eager, which
        captures none (FlashInfer's workspace then needs no room for graphs' tiles)."""
        if self.enforce_eager:
            return 0
        return self.cuda_graph_max_batch_size or self.max_num_seqs

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model.rstrip("/").rsplit("/", 1)[-1]


def check_url_prefixes(setting: str) -> None:
    """Each comma-separated entry of --allowed-feature-url-prefixes names a folder: an
    http(s):// or s3:// prefix ends in '/' (else https://a.example also lets
    https://a.example.evil.net in, and s3://feat the bucket feat-other), or is `data:`."""
    for entry in (item.strip() for item in setting.split(",")):
        if not entry or entry.startswith("data:"):  # empty: skipped (a trailing comma)
            continue
        # s3:// as a feature URL spells it (an http(s) URL is compared in its normal form)
        if not entry.lower().startswith(("http://", "https://")) and not entry.startswith("s3://"):
            raise ValueError(
                f"allowed_feature_url_prefixes entry {entry!r} must begin with http://, "
                "https://, s3:// or data:"
            )
        if not entry.endswith("/"):
            raise ValueError(
                f"allowed_feature_url_prefixes entry {entry!r} must end in '/': without it, "
                f"{entry}.evil.net and {entry}-other would be let in too"
            )


def check_ranges(
    settings: Any, *, positive: Iterable[str] = (), non_negative: Iterable[str] = ()
) -> None:
    """Raises ValueError naming the first field of the dataclass `settings` out of its range:
    any float that is not finite (NaN or infinity; no setting means "never" by it), then the
    `positive` fields at 0 or below and the `non_negative` ones below 0. An unset (None)
    optional field passes."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{field.name} must be a finite number, got {value}")
    for names, holds, wanted in ((positive, lambda v: v > 0, "positive"),
                                 (non_negative, lambda v: v >= 0, ">= 0")):  # fmt: skip
        for name in names:
            value = getattr(settings, name)
            if value is not None and not holds(value):
                raise ValueError(f"{name} must be {wanted}, got {value}")
