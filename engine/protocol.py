"""The wire contract between the server process and the engine process.

Only msgspec Structs and enums live here. Messages are msgpack-encoded; tensors
(pixel values, pre-encoded features) travel as raw buffers in extra ZMQ frames,
described by a `TensorRef` (frame index, dtype, shape). Nothing is pickled.

Direction server -> engine: `EngineRequest`, `AbortRequests`, `Shutdown`, and `MediaUuid`
(a media uuid an API process learnt, for the engine to relay) (decoded with
`ENGINE_INBOX_DECODER`).
Direction engine -> server: `Ready`, `EngineOutputs`, `EngineFailed`, the relayed
`MediaUuid`s (to the other API processes), and `Heartbeat` (to every API process about once
a second) (decoded with `SERVER_INBOX_DECODER`).
"""

from __future__ import annotations

import enum

import msgspec


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a sequence's text must match; exactly one field is set. `json` is a JSON Schema
    as JSON text (`{"type": "object"}`: any object), `regex` a regular expression the whole
    output matches, `choice` the strings of which the output is one, `grammar` a
    context-free grammar in Lark or GBNF syntax (vLLM's `grammar`, as llguidance reads it).
    The engine masks every token the grammar does not allow (engine/structured_output.py)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str = "structured_output"  # the request field it came from, for error messages

    def __post_init__(self) -> None:
        # A list, as the HTTP field takes it, from an offline caller: the grammar cache
        # hashes the spec (a list failed the request with "unhashable type").
        if isinstance(self.choice, str):  # tuple("yes") would be three one-letter choices
            raise TypeError("choice must be a list of strings, not one string")
        if self.choice is not None and not isinstance(self.choice, tuple):
            msgspec.structs.force_setattr(self, "choice", tuple(self.choice))


GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS
# Alternatives per token (logprobs, prompt_logprobs): vLLM's --max-logprobs default.
DEFAULT_MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How to pick tokens for one sequence. Validated by the server before sending.

    `top_k == 0` and `top_p == 1.0` and `min_p == 0.0` mean "off". `logprobs is None`
    means no logprobs; `logprobs == k` returns the chosen token's logprob plus the
    top-k alternatives. A `seed` makes the sequence reproducible whatever else is
    in the batch. `logit_bias` holds (token id, bias) pairs added to those tokens' logits
    before any token is picked (OpenAI's `logit_bias`; ids distinct). Until `min_tokens`
    tokens are out, EOS (unless `ignore_eos`) and `stop_token_ids` cannot be picked. With
    `structured_output` only tokens its grammar allows can be, and the sequence finishes
    ("stop") once the grammar is complete. `allowed_token_ids` (vLLM's) restricts every
    pick to those tokens (with a grammar, to those both allow). `prompt_logprobs == k`
    scores every prompt token but the first, with k alternatives (engine/prompt_logprobs.py).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # score each prompt token, with this many alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # None: any token
    # Token sequences that are never completed: a sequence's last token is banned wherever
    # its other tokens end the prompt and output so far (transformers' `bad_words_ids`).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_output: StructuredOutput | None = None
    # The grammar holds only after the output has written these tokens (the end of a
    # reasoning model's thinking, `</think>`); empty: from the first token.
    structured_output_after: tuple[int, ...] = ()

    @property
    def is_greedy(self) -> bool:
        # As vLLM: a temperature this small is greedy. Dividing by it would overflow
        # float32 logits to inf below ~1e-37 (softmax NaN, a garbage token).
        # top_k 1 keeps only the largest logit, so sampling picks it: the argmax, without
        # sorting, softmax and noise over the vocabulary (Qwen2-VL's generation_config
        # asks for top_k 1 with temperature 0.01, applied to every request by default: 413
        # against 16 ms a step for 32 rows of 152k logits on one CPU thread).
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalties: sampling reads the output so far."""
        return self.repetition_penalty != 1.0 or self.has_output_penalties

    @property
    def has_output_penalties(self) -> bool:
        """Presence or frequency penalties (OpenAI's), which count the output tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_output_on_host(self) -> bool:
        """Picking the next token needs the tokens so far on the host (a grammar, bad words
        of several tokens): the scheduler skips such a request while a token of it is in
        flight (overlap scheduling). Penalties read them too, but on the device, where the
        sampler counts a token still in flight (engine/penalties.py, `InFlightOutputs`)."""
        return self.structured_output is not None or any(
            len(word) > 1 for word in self.bad_words_token_ids
        )


class TensorRef(msgspec.Struct, frozen=True):
    """A tensor carried in extra frame number `frame` (0 = first frame after the message)."""

    frame: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "bfloat16"
    shape: tuple[int, ...]


class Modality(str, enum.Enum):
    IMAGE = "image"
    VIDEO = "video"


class FeatureSource(msgspec.Struct, frozen=True):
    """Where the engine's FeatureFetcher downloads pre-encoded features from."""

    url: str
    # Part of the file (one temporal patch of a Qwen3-VL video, its own media item): rows
    # [start, stop) of a file whose whole grid is `file_grid_thw`. None = the whole file.
    rows: tuple[int, int] | None = None
    file_grid_thw: tuple[int, int, int] | None = None


class PixelNormalization(msgspec.Struct, frozen=True, array_like=True):
    """How uint8 pixel levels become encoder input, per channel c:
    `(level * rescale_factor - mean[c]) / std[c]`, with transformers' arithmetic (see
    `engine.multimodal.image_processor.normalization_table`)."""

    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]


class MediaInput(msgspec.Struct, frozen=True, kw_only=True):
    """One media item of a request and the placeholder span it fills.

    `offset` is the index in `prompt_token_ids` of the first placeholder token and
    `num_tokens` the number of placeholders (= encoder output rows). Exactly one
    of `pixel_values` / `feature` is set, or neither when the engine is expected
    to hold `content_hash` in its encoder cache already.

    `pixel_values` are either uint8 levels with a `normalization` (what the server sends:
    a quarter of float32's bytes, normalised on the engine's device) or floating-point
    values already normalised (`normalization` None).

    `second_per_grid_t` is, for a video, the seconds of video one temporal patch spans
    (temporal_patch_size / the sampled frame rate): Qwen2.5-VL spaces the video's M-RoPE
    temporal positions by it. 1.0 (transformers' default) where unknown; images ignore it.
    """

    modality: Modality
    content_hash: str  # blake3 hex of decoded content + processing parameters
    offset: int
    num_tokens: int
    grid_thw: tuple[int, int, int]
    pixel_values: TensorRef | None = None  # [num_patches, C * T_patch * P * P]
    normalization: PixelNormalization | None = None  # set iff pixel_values are uint8
    feature: FeatureSource | None = None
    second_per_grid_t: float = 1.0
    # A video laid out temporal patch by temporal patch (Qwen3-VL): which patch this item
    # is (its key in the encoder cache is the video's and this index).
    frame: int | None = None


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    media: list[MediaInput] = []
    arrival_time: float = 0.0  # time.time() when the server received it
    priority: int = 0  # --scheduling-policy priority: lower runs first (vLLM's)
    # vLLM's: requests share prefix-cache blocks only with requests of the same salt
    cache_salt: str | None = None


class AbortRequests(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class MediaUuid(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """What a client's media uuid names: an API process that processed the media sends it
    to the engine, which relays it to the other API processes (`--api-server-count`), so
    that a later uuid-only part builds its placeholders whichever process it reaches."""

    uuid: str
    modality: Modality
    grid_thw: tuple[int, int, int]
    num_tokens: int
    second_per_grid_t: float = 1.0
    frame_seconds: tuple[float, ...] = ()
    cache_salt: str | None = None  # known only to requests of this salt
    processing: str = ""  # ... and sent under these preprocessing settings (a digest)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token (stop strings are the server's job)
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"


class ErrorInfo(msgspec.Struct, frozen=True):
    """A per-request failure, mapped by the server onto an OpenAI error body."""

    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    status: int = 400


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []  # (token_id, logprob), best first
    rank: int | None = None  # prompt logprobs: how many tokens are at least as likely (vLLM's)


class RequestOutput(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What one request produced in one step. `finish_reason` set means it is done."""

    request_id: str
    new_token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    # SamplingParams.prompt_logprobs: prompt tokens 1.. (token 0 has no score), on the
    # output that carries the first sampled token.
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Engine-side phases of the request, in seconds; set on the finishing output only.
    queued_seconds: float | None = None  # entered the scheduler's queue -> first scheduled
    prefill_seconds: float | None = None  # first scheduled -> first token
    decode_seconds: float | None = None  # first token -> last token
    # The tokens the engine generated for the request in all, those no client read included
    # (past a stop string, after the client left); set on the finishing output only.
    num_output_tokens: int | None = None


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """Gauges are current values; `*_total` fields are deltas since the last message."""

    num_running: int = 0
    num_waiting: int = 0  # not yet scheduled, including those whose grammar compiles
    num_fetching: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    encoder_cache_usage: float = 0.0  # fraction of --encoder-cache-tokens held, 0..1
    num_preemptions_total: int = 0
    num_scheduled_tokens: int = 0
    step_seconds: float = 0.0
    vision_encoder_seconds: float = 0.0
    vision_encoder_items_total: int = 0
    vision_encoder_batches_total: int = 0
    encoder_cache_queries_total: int = 0
    encoder_cache_hits_total: int = 0
    prefix_cache_queries_total: int = 0  # tokens
    prefix_cache_hits_total: int = 0  # tokens
    # Counted as the engine makes them (vLLM's unit): every sampled token, those no client
    # reads included (past a stop string, after a client left), and each request's prompt
    # at its first token (n > 1: once a choice).
    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0  # of prompt_tokens_total, from the prefix cache
    generation_tokens_total: int = 0
    feature_fetch_seconds: list[float] = []  # one per finished feature download
    feature_fetch_bytes_total: int = 0
    feature_fetch_failures: dict[str, int] = {}  # reason -> count since the last message
    feature_fetch_in_flight: int = 0
    feature_fetch_bytes_reserved: int = 0  # held in --feature-fetch-max-bytes-in-flight


class EngineOutputs(msgspec.Struct, frozen=True, tag=True):
    outputs: list[RequestOutput]
    stats: EngineStats


class Ready(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The READY handshake: facts the server needs, resolved by the engine at start-up."""

    model_name: str
    max_model_len: int
    vocab_size: int
    hidden_size: int
    block_size: int
    num_kv_blocks: int
    eos_token_ids: list[int]
    modalities: list[Modality]
    dtype: str
    device: str


class EngineFailed(msgspec.Struct, frozen=True, tag=True):
    """The engine hit an unrecoverable error and is about to exit."""

    message: str


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    """The engine loop went round: sent to every API process about once a second, so that
    one with requests in flight that hears nothing for engine_step_timeout_s knows the
    engine is hung where its own step watchdog cannot act (stopped by SIGSTOP, or stuck
    in a call that holds the GIL)."""


ServerToEngine = EngineRequest | AbortRequests | Shutdown | MediaUuid
EngineToServer = Ready | EngineOutputs | EngineFailed | MediaUuid | Heartbeat

ENCODER = msgspec.msgpack.Encoder()
ENGINE_INBOX_DECODER = msgspec.msgpack.Decoder(ServerToEngine)
SERVER_INBOX_DECODER = msgspec.msgpack.Decoder(EngineToServer)
