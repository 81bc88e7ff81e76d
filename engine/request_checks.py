"""Admission checks: an `EngineRequest` from the server, checked against the model and the
engine's settings, becomes the engine's `Request`.

Bad input is the client's (HTTP 400): a check raises a TesseraError naming the field, and
`EngineCore.add_request` finishes that request with it. Every check here guards the rest
of the batch too: an id past the vocabulary, a media span off its placeholders or pixels
of the wrong shape would otherwise fail a whole step.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from collections.abc import Collection, Container, Sequence

import torch

from engine.choices import SEED_RANGE, is_seed
from engine.encoder_cache import salted
from engine.errors import ContextLengthExceeded, InvalidRequest, MediaError, unknown_media_uuid
from engine.model_config import ModelConfig
from engine.models.mrope import mrope_positions
from engine.multimodal.image_processor import normalization_table
from engine.protocol import (
    EngineRequest,
    MediaInput,
    Modality,
    PixelNormalization,
    SamplingParams,
)
from engine.request import MediaItem, Request
from engine.sampler import token_bitmask


def check_prompt_token_ids(prompt: Sequence[int], vocab_size: int, *, types: bool) -> None:
    """InvalidRequest unless every id is in the vocabulary, and with `types` an integer
    (numpy's too; not a bool): a float, a bool or a nested list from the offline `LLM`'s
    caller raised out of the tokenizer for the whole batch (fuzz87); msgspec has typed
    what the server sends."""
    if types and not all(
        isinstance(token_id, numbers.Integral) and not isinstance(token_id, bool)
        for token_id in prompt
    ):
        raise InvalidRequest("a token-id prompt is a list of ints", param="prompt")
    if prompt and (min(prompt) < 0 or max(prompt) >= vocab_size):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", param="prompt")


SERVER_PRIORITY_SETTING = "the server's --scheduling-policy priority"


class RequestBuilder:
    """Builds checked Requests for one model and engine (`EngineCore._builder`)."""

    def __init__(
        self,
        model_config: ModelConfig,
        max_model_len: int,
        scheduling_policy: str,
        encoder_cache: Container[str],
        *,
        max_logprobs: int,  # EngineConfig.max_logprobs
        priority_setting: str = SERVER_PRIORITY_SETTING,
    ) -> None:
        """`priority_setting`: how the caller turns priority scheduling on, for the error of a
        priority under another policy (the server's flag; the offline LLM's keyword)."""
        self.model_config = model_config
        self.priority_setting = priority_setting
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self.scheduling_policy = scheduling_policy
        self.encoder_cache = encoder_cache  # the runner's: a uuid-only part must be in it

    def build(self, request: EngineRequest, tensors: Sequence[torch.Tensor] = ()) -> Request:
        """The engine's Request of `request`, every field checked; bad input raises a
        TesseraError naming the field (`tensors[i]`: the tensor of TensorRef frame i)."""
        mc = self.model_config
        prompt = request.prompt_token_ids
        max_len = self.max_model_len
        max_tokens = request.sampling.max_tokens
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        check_prompt_token_ids(prompt, mc.vocab_size, types=False)
        if not 0 <= request.sampling.min_tokens <= max_tokens:
            raise InvalidRequest(
                f"min_tokens must be in [0, max_tokens={max_tokens}], "
                f"got {request.sampling.min_tokens}",
                param="min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            # A negative count would fail the sampler's or the scorer's topk for the batch;
            # a huge one would send the whole vocabulary for every token.
            if not 0 <= (getattr(request.sampling, name) or 0) <= self.max_logprobs:
                raise InvalidRequest(
                    f"{name} must be in [0, {self.max_logprobs}] (the server's max_logprobs)",
                    param=name,
                )

        def in_vocabulary(token_ids: Sequence[int]) -> bool:
            return all(0 <= token_id < mc.vocab_size for token_id in token_ids)

        for token_id, bias in request.sampling.logit_bias:
            # An id past the logits would fail the sampler's step for the whole batch.
            if not in_vocabulary((token_id,)) or not math.isfinite(bias):
                raise InvalidRequest(
                    f"logit_bias needs token ids in [0, {mc.vocab_size}) and finite biases",
                    param="logit_bias",
                )
        allowed = request.sampling.allowed_token_ids
        if allowed is not None and not (allowed and in_vocabulary(allowed)):
            raise InvalidRequest(
                f"allowed_token_ids needs at least one token id, each in [0, {mc.vocab_size})",
                param="allowed_token_ids",
            )
        for word in request.sampling.bad_words_token_ids:
            if not (word and in_vocabulary(word)):
                raise InvalidRequest(
                    f"bad words need at least one token, each id in [0, {mc.vocab_size})",
                    param="bad_words",
                )
        _check_sampling_ranges(request.sampling)
        _check_some_token_is_allowed(request.sampling, mc.eos_token_ids)
        if request.priority and self.scheduling_policy != "priority":
            raise InvalidRequest(f"priority needs {self.priority_setting}", param="priority")
        # One token sampled after a prompt that fills the context needs no room of its own
        # (it is never fed back): how a prompt-only request (echo, max_tokens 0) scores a
        # full window.
        fills_and_samples_one = len(prompt) == max_len and max_tokens == 1
        if len(prompt) >= max_len and not fills_and_samples_one:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt)} tokens but the model's context length is {max_len}",
                param="messages",
            )
        if len(prompt) + max_tokens > max_len and not fills_and_samples_one:
            raise ContextLengthExceeded(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context length of {max_len}",
                param="max_tokens",
            )
        if request.media and mc.vision is None:
            raise InvalidRequest("this model takes no images or videos", param="messages")
        if mc.vision is not None and mc.vision.variant == "qwen3_vl":
            if any(m.modality == Modality.VIDEO and m.grid_thw[0] != 1 for m in request.media):
                raise InvalidRequest(
                    "Qwen3-VL takes a video as one media item per temporal patch (grid_thw "
                    "t = 1), each after its time in the prompt; video features are not "
                    "supported for it",
                    param="messages",
                )
        # A uuid-only part may name media that an earlier part of this same request sends
        # (a conversation's history): that item's pixels serve both.
        salt = request.cache_salt
        sent = {_cache_key(m, salt) for m in request.media if m.pixel_values is not None}
        media = [self._media_item(m, i, tensors, sent, salt) for i, m in enumerate(request.media)]
        media = _share_pixels(media)
        self._check_placeholders(prompt, media)
        positions, rope_delta = mrope_positions(
            prompt,
            [(m.offset, m.num_tokens, m.grid_thw, m.modality) for m in media],
            spatial_merge_size=mc.vision.spatial_merge_size if mc.vision else 1,
            tokens_per_second=mc.vision.tokens_per_second if mc.vision else None,
            second_per_grid_ts=[m.second_per_grid_t for m in request.media],
        )
        result = Request(
            request.request_id,
            prompt,
            request.sampling,
            media=media,
            arrival_time=request.arrival_time or time.time(),
            eos_token_ids=mc.eos_token_ids,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        result.positions, result.rope_delta = positions, rope_delta  # [3, L]
        if allowed is not None:
            result.allowed_token_mask = token_bitmask(allowed, mc.vocab_size)
        return result

    def _media_item(
        self,
        media: MediaInput,
        index: int,
        tensors: Sequence[torch.Tensor],
        sent: Collection[str] = (),
        salt: str | None = None,
    ) -> MediaItem:
        """The engine's item of `media`, checked; `sent`: the cache keys whose pixels this
        request carries; `salt`: the request's `cache_salt`."""
        vision = self.model_config.vision
        param = f"media[{index}]"
        t, h, w = media.grid_thw
        merge = vision.spatial_merge_size
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise MediaError(f"grid_thw {tuple(media.grid_thw)} is invalid", param=param)
        if t * h * w // merge**2 != media.num_tokens:
            raise MediaError(
                f"{media.num_tokens} placeholders do not match grid_thw {tuple(media.grid_thw)}",
                param=param,
            )
        if not (math.isfinite(media.second_per_grid_t) and media.second_per_grid_t > 0):
            raise MediaError("second_per_grid_t must be positive", param=param)
        cache_key = _cache_key(media, salt)
        pixel_values = None
        if media.pixel_values is not None:
            ref = media.pixel_values
            if not 0 <= ref.frame < len(tensors):
                raise MediaError("pixel values frame is missing", param=param)
            pixel_values = tensors[ref.frame]
            patch_dim = vision.patch_dim
            if tuple(pixel_values.shape) != (t * h * w, patch_dim):
                raise MediaError(
                    f"pixel values of shape {tuple(pixel_values.shape)} do not match grid_thw "
                    f"{tuple(media.grid_thw)} (expected {(t * h * w, patch_dim)})",
                    param=param,
                )
            _check_pixel_encoding(pixel_values, media.normalization, vision.in_channels, param)
        elif media.feature is not None:  # fetched before the request is scheduled
            _check_feature_rows(media, param)
        elif media.content_hash.startswith("uuid:"):
            if cache_key not in self.encoder_cache and cache_key not in sent:
                raise unknown_media_uuid(
                    media.content_hash.removeprefix("uuid:"),
                    "send the media with its uuid first (it may also have been evicted)",
                    param=param,
                )
        elif cache_key not in self.encoder_cache:
            raise MediaError("media item has no pixel values and is not cached", param=param)
        is_timed = vision.tokens_per_second is not None and media.modality is Modality.VIDEO
        return MediaItem(
            media.modality.value,
            cache_key,
            media.offset,
            media.num_tokens,
            tuple(media.grid_thw),
            pixel_values,
            media.normalization if pixel_values is not None else None,
            second_per_grid_t=media.second_per_grid_t if is_timed else None,
            cached_only=pixel_values is None and media.feature is None,
        )

    def _check_placeholders(self, prompt: list[int], media: list[MediaItem]) -> None:
        mc = self.model_config
        placeholder_ids = {"image": mc.image_token_id, "video": mc.video_token_id}
        cursor = 0
        for index, item in enumerate(media):
            if item.offset < cursor or item.end > len(prompt):
                raise MediaError(
                    f"{item.modality} span at {item.offset} overlaps another span "
                    "or leaves the prompt",
                    param=f"media[{index}]",
                )
            span = prompt[item.offset : item.end]
            if span.count(placeholder_ids[item.modality]) != len(span):  # C loops, not Python
                raise MediaError(
                    f"{item.modality} span at {item.offset} is not made of placeholder tokens",
                    param=f"media[{index}]",
                )
            cursor = item.end
        ids = {token_id for token_id in placeholder_ids.values() if token_id is not None}
        num_placeholders = sum(prompt.count(token_id) for token_id in ids)
        num_expected = sum(item.num_tokens for item in media)
        if num_placeholders != num_expected:
            raise MediaError(
                f"the prompt has {num_placeholders} media placeholder tokens but "
                f"the media items fill {num_expected}",
                param="messages",
            )


def _check_pixel_encoding(
    pixel_values: torch.Tensor,
    normalization: PixelNormalization | None,
    channels: int,
    param: str,
) -> None:
    """uint8 levels need a `normalization` for the model's channels that gives finite
    values; floating-point values are taken as already normalised."""
    if pixel_values.dtype == torch.uint8:
        if normalization is None:
            raise MediaError("uint8 pixel values need a normalization", param=param)
        if len(normalization.mean) != channels or len(normalization.std) != channels:
            raise MediaError(
                f"the normalization must have {channels} means and stds (one per channel)",
                param=param,
            )
        if not torch.isfinite(normalization_table(normalization)).all():
            raise MediaError("the normalization gives non-finite pixel values", param=param)
    elif not pixel_values.is_floating_point():
        raise MediaError(
            f"pixel values must be uint8 levels or floating point, not {pixel_values.dtype}",
            param=param,
        )
    elif normalization is not None:
        raise MediaError("a normalization applies to uint8 pixel values only", param=param)


def _check_feature_rows(media: MediaInput, param: str) -> None:
    """A part of a feature file (one temporal patch) is one patch's rows of a file of the
    same frame size."""
    source = media.feature
    if source is None or (source.rows is None and source.file_grid_thw is None):
        return
    t, h, w = media.grid_thw
    if source.rows is None or source.file_grid_thw is None:
        raise MediaError("a feature part needs both its rows and its file's grid", param=param)
    start, stop = source.rows
    file_t, file_h, file_w = source.file_grid_thw
    whole = media.num_tokens * file_t
    if (
        (t, file_h, file_w) != (1, h, w)
        or stop - start != media.num_tokens
        or not (0 <= start and stop <= whole and start % media.num_tokens == 0)
    ):
        raise MediaError(
            f"feature rows {source.rows} are not one temporal patch of a file of grid "
            f"{tuple(source.file_grid_thw)}",
            param=param,
        )


def _cache_key(media: MediaInput, salt: str | None) -> str:
    """The encoder cache's key of a media item. A client may send one uuid with pictures of
    different sizes, or with an image and then a video: rows cached for one must never be
    spliced into another's placeholders (a wrong answer, or a step failed for every
    request in it), so a uuid names its rows per modality and grid. Under a `cache_salt`
    the key is the salt's own (`salted`). A video's temporal patch adds its index after
    all that, where `uuid_of` reads past it (it was within the uuid, and the error of an
    evicted one named "V1/t0" for the client's "V1": fuzz46)."""
    key = media.content_hash
    if key.startswith("uuid:"):
        t, h, w = media.grid_thw
        key = f"{key}@{media.modality.value}:{t}x{h}x{w}"
    if media.frame is not None:
        key = f"{key}/t{media.frame}"
    return salted(key, salt)


def _share_pixels(media: list[MediaItem]) -> list[MediaItem]:
    """Items without pixels take those of an item of the same key that has them, so
    whichever the scheduler meets first can be encoded."""
    with_pixels = {item.content_hash: item for item in media if item.pixel_values is not None}
    return [
        dataclasses.replace(
            item, pixel_values=source.pixel_values, normalization=source.normalization
        )
        if item.pixel_values is None
        and item.embeds is None
        and (source := with_pixels.get(item.content_hash)) is not None
        else item
        for item in media
    ]


# The ranges vLLM's SamplingParams checks, for every caller of the engine (the offline LLM
# included; the HTTP API also bounds temperature at 2, as OpenAI does): name -> (lowest,
# highest, whether the lowest itself is refused). The penalties' [-2, 2] were unbounded
# here, so the offline LLM took what the server and vLLM refuse (fuzz87).
_SAMPLING_RANGES = {
    "temperature": (0.0, math.inf, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, math.inf, True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
}


def _check_sampling_ranges(sampling: SamplingParams) -> None:
    """A value outside its range drew garbage (a NaN temperature) or failed the step of
    every request beside it (a seed torch cannot take)."""
    for name, (low, high, low_refused) in _SAMPLING_RANGES.items():
        value = getattr(sampling, name)
        if not (
            isinstance(value, int | float)
            and math.isfinite(value)
            and (low < value if low_refused else low <= value)
            and value <= high
        ):
            low_end = f"{'>' if low_refused else '>='} {low}" if math.isfinite(low) else ""
            high_end = f"<= {high}" if math.isfinite(high) else ""
            bounds = " and ".join(end for end in (low_end, high_end) if end)
            raise InvalidRequest(
                f"{name} must be a finite number{' ' + bounds if bounds else ''}, got {value!r}",
                param=name,
            )
    if not (isinstance(sampling.top_k, int) and sampling.top_k >= -1):
        raise InvalidRequest(
            f"top_k must be an integer >= -1, got {sampling.top_k!r}", param="top_k"
        )
    seed = sampling.seed
    if seed is not None and not is_seed(seed):
        raise InvalidRequest(
            f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed!r}",
            param="seed",
        )


def _check_some_token_is_allowed(sampling: SamplingParams, eos_token_ids: Sequence[int]) -> None:
    """Refuses `allowed_token_ids` that the request's own bans empty: bad words of one token
    at every step, or EOS and stop tokens before `min_tokens` (`engine/token_bans.py`).
    With every logit -inf the sampler would pick id 0, a token the request did not allow."""
    allowed = sampling.allowed_token_ids
    if allowed is None:
        return
    left = set(allowed) - {word[0] for word in sampling.bad_words_token_ids if len(word) == 1}
    if not left:
        raise InvalidRequest("every token of allowed_token_ids is a bad word", param="bad_words")
    ends = set(sampling.stop_token_ids) | set(eos_token_ids)  # banned with ignore_eos too
    if sampling.min_tokens > 0 and not left - ends:
        raise InvalidRequest(
            "allowed_token_ids leaves only tokens that end the answer (EOS, stop_token_ids), "
            f"which min_tokens ({sampling.min_tokens}) forbids until that many tokens",
            param="min_tokens",
        )
