"""Chat request -> prompt token ids + media (MediaInput + pixel tensors) for the engine.

Media parts, in prompt order, are one of:

* `image_url` / `video_url` — fetched, decoded and preprocessed concurrently (media_fetch;
  a video's frames are sampled first, engine/multimodal/video.py), under the server's
  settings or those the request's `mm_processor_kwargs` narrow them to. With a client
  `uuid` the engine caches the encoding under `uuid:<uuid>` (per grid); a later part with
  the same uuid and no URL reuses it (the server remembers the uuid's modality and grid,
  the engine its rows).
* `image_features` / `video_features` — pre-encoded features the engine's FeatureFetcher
  downloads (only with `--enable-feature-inputs`, URL checked against the allowlists here).
  The token count comes from `grid_thw`; `content_hash` is a hash of the URL for now (the
  engine re-keys the rows by the blake3 of the file's bytes).

Then the chat template is rendered with one placeholder per item and each placeholder
widened to the item's token count; the spans give every MediaInput its `offset`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from engine.errors import ContextLengthExceeded, InvalidRequest, MediaError, unknown_media_uuid
from engine.multimodal.image_processor import ImageProcessorConfig, ProcessedImage
from engine.multimodal.placement import media_input, place_media
from engine.multimodal.prompt import PromptProcessor, final_message_text
from engine.multimodal.tool_call_history import arguments_as_objects
from engine.protocol import FeatureSource, MediaInput, MediaUuid, Modality
from engine.url_safety import as_fetched, is_under_prefixes
from server.chat_messages import (
    ChatMessage,
    ImageFeaturesPart,
    ImagePart,
    VideoFeaturesPart,
    VideoPart,
)
from server.generation import PreparedPrompt
from server.media_fetch import MediaFetcher, MediaProcessing
from server.openai_models import ChatCompletionRequest
from server.settings import ServerSettings

FEATURE_SCHEMES = ("s3://", "http://", "https://", "data:")


# What botocore takes as a bucket name (older us-east-1 buckets may hold capitals and '_'; an
# access point's alias is one too); an ARN, which it routes to the host it names, is not.
S3_BUCKET_NAME = re.compile(r"[a-zA-Z0-9._-]{1,255}")


@dataclass(frozen=True)
class MediaPart:
    """One media content part, in prompt order."""

    param: str  # "messages[i].content[j]"
    modality: Modality
    url: str | None  # image, video or feature URL; None = a uuid-only image or video
    uuid: str | None = None
    grid_thw: tuple[int, int, int] | None = None  # feature parts only
    is_feature: bool = False
    second_per_grid_t: float | None = None  # video feature parts only, None = the default
    frame_seconds: tuple[float, ...] = ()  # video feature parts only: each patch's time


def media_parts(messages: list[ChatMessage]) -> list[MediaPart]:
    found = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            param = f"messages[{i}].content[{j}]"
            if isinstance(part, ImagePart | VideoPart):
                url = part.url
                if not url and not part.uuid:
                    raise InvalidRequest(
                        f"the {part.url_field} part needs a url or a uuid", param=param
                    )
                modality = Modality.IMAGE if isinstance(part, ImagePart) else Modality.VIDEO
                found.append(MediaPart(param, modality, url or None, part.uuid))
            elif isinstance(part, ImageFeaturesPart | VideoFeaturesPart):
                is_image = isinstance(part, ImageFeaturesPart)
                ref = part.image_features if is_image else part.video_features
                param += ".image_features" if is_image else ".video_features"  # the field
                grid = ref.grid_thw
                if len(grid) != 3 or min(grid) < 1:
                    raise InvalidRequest(
                        "grid_thw must be 3 positive integers [t, h, w]", param=param + ".grid_thw"
                    )
                modality = Modality.IMAGE if is_image else Modality.VIDEO
                found.append(
                    MediaPart(param, modality, ref.url, None, tuple(grid), True,
                              ref.second_per_grid_t, tuple(ref.frame_seconds or ()))
                )  # fmt: skip
    return found


def messages_as_dicts(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them, as vLLM hands them over: a null
    `content` is "" (an assistant turn of tool calls only, as the openai client sends it
    back: Qwen3's template failed on the missing key), and an earlier answer's thinking is
    there under both `reasoning_content` and `reasoning`."""
    result = []
    for message in messages:
        as_dict = message.model_dump(exclude_none=True)
        as_dict.setdefault("content", "")
        thinking = message.reasoning_content
        thinking = message.reasoning if thinking is None else thinking
        if thinking is not None:
            as_dict["reasoning_content"] = as_dict["reasoning"] = thinking
        result.append(as_dict)
    return result


@dataclass(frozen=True)
class FeaturePolicy:
    """Whether feature parts are accepted, from where, the model's merge size, and the
    seconds per temporal patch of a video sampled by this server (temporal_patch_size /
    --video-fps: a video_features part's default)."""

    is_enabled: bool
    buckets: frozenset[str] | None
    url_prefixes: tuple[str, ...] | None
    merge_size: int
    default_second_per_grid_t: float = 1.0

    @classmethod
    def from_settings(cls, settings: Any) -> FeaturePolicy:
        return _policy(
            bool(getattr(settings, "enable_feature_inputs", False)),
            getattr(settings, "allowed_feature_buckets", None),
            settings.engine.allowed_feature_url_prefixes,
            settings.engine.model,
            float(getattr(settings, "video_fps", 2.0)),
        )

    def check(self, part: MediaPart) -> None:
        kind = f"{part.modality.value}_features"
        if not self.is_enabled:
            raise InvalidRequest(
                f"{kind} parts are disabled on this server (--enable-feature-inputs)",
                param=part.param,
            )
        url = part.url or ""
        if not url.startswith(FEATURE_SCHEMES):
            raise InvalidRequest(
                "a feature URL must be s3://, http(s):// or data:", param=part.param + ".url"
            )
        if url.startswith("s3://"):
            bucket = url.removeprefix("s3://").split("/", 1)[0]
            if not S3_BUCKET_NAME.fullmatch(bucket):
                # botocore routes an ARN to the host it names: the server's signed request
                # would go where the client says (another account's access point, a lambda).
                raise InvalidRequest(
                    f"{bucket[:100]!r} is not an S3 bucket name (letters, digits, '.', '_' "
                    "and '-'; not an access point ARN)",
                    param=part.param + ".url",
                )
            if self.buckets is not None and bucket not in self.buckets:
                raise InvalidRequest(
                    f"bucket {bucket!r} is not in the allowed feature buckets",
                    param=part.param + ".url",
                )
        if self.url_prefixes is not None and not is_under_prefixes(url, self.url_prefixes):
            shown = "a data: URL" if url.startswith("data:") else f"URL {url[:200]!r}"
            raise InvalidRequest(
                f"{shown} is not under an allowed feature URL prefix", param=part.param + ".url"
            )
        t, h, w = part.grid_thw or (0, 0, 0)
        if h % self.merge_size or w % self.merge_size:
            raise InvalidRequest(
                f"grid_thw {[t, h, w]}: h and w must be multiples of the merge size "
                f"{self.merge_size}",
                param=part.param + ".grid_thw",
            )

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2

    def check_fits(self, part: MediaPart, max_model_len: int) -> None:
        """A grid of more rows than the context holds is refused before its placeholders
        are laid out: [1, 2**20, 2**20] asked for a list of 2**38 ids (a MemoryError, and
        gigabytes held for seconds by a 600-byte request)."""
        num_tokens = self.num_tokens(part.grid_thw)  # type: ignore[arg-type]
        if num_tokens > max_model_len:
            raise ContextLengthExceeded(
                f"grid_thw {list(part.grid_thw)} makes {num_tokens} tokens, more than this "  # type: ignore[arg-type]
                f"model's context length of {max_model_len}",
                param=part.param + ".grid_thw",
            )


def _split(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(item.strip() for item in value.split(",") if item.strip())


@functools.lru_cache(maxsize=8)  # read per request: preprocessor_config.json once
def _policy(enabled: bool, buckets: str | None, prefixes: str | None, model: str, fps: float):
    merge, temporal_patch = 2, 2
    if (Path(model) / "preprocessor_config.json").is_file():
        config = ImageProcessorConfig.from_model_dir(model)
        merge, temporal_patch = config.merge_size, config.temporal_patch_size
    bucket_list, prefix_list = _split(buckets), _split(prefixes)
    return FeaturePolicy(
        enabled,
        None if bucket_list is None else frozenset(bucket_list),
        None if prefix_list is None else tuple(as_fetched(p) for p in prefix_list),
        merge,
        temporal_patch / fps,
    )


_NO_SCOPES: Mapping[Modality, str] = {}


class UuidRegistry:
    """(cache_salt, uuid, processing) -> (modality, the latest ProcessedImage's facts) of
    media sent with a client uuid: a uuid is known only to requests of its salt, and under
    the preprocessing of its kind it was sent with (`processing`: a digest of the settings
    after the request's mm_processor_kwargs; a uuid-only part under other kwargs was
    answered at the size another request had asked for, where vLLM's lookup misses;
    fuzz69). At most `capacity` of them (`--max-remembered-media-uuids`); the one least
    recently sent or named goes first (a uuid named by every request but sent once was
    forgotten behind a stream of new ones)."""

    def __init__(self, capacity: int = ServerSettings.max_remembered_media_uuids) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[
            tuple[str | None, str, str], tuple[Modality, RememberedMedia]
        ] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._share: Callable[[MediaUuid], Any] | None = None

    def share_with(self, send: Callable[[MediaUuid], Any]) -> None:
        """`send(MediaUuid)` for each uuid remembered from now on: the engine relays it to
        the other API processes, whose registries `learn` it."""
        self._share = send

    def remember(
        self,
        uuid: str,
        modality: Modality,
        salt: str | None,
        image: ProcessedImage,
        processing: str = "",
    ) -> None:
        facts = RememberedMedia(
            tuple(image.grid_thw), image.num_tokens, image.second_per_grid_t, image.frame_seconds
        )  # fmt: skip
        self._store((salt, uuid, processing), modality, facts)
        self._tell_the_others(uuid, salt, processing, modality, facts)

    def _tell_the_others(
        self,
        uuid: str,
        salt: str | None,
        processing: str,
        modality: Modality,
        facts: RememberedMedia,
    ) -> None:
        """The other API processes remember the uuid too, as last used now."""
        if self._share is not None:
            self._share(MediaUuid(uuid=uuid, cache_salt=salt, processing=processing,
                                  modality=modality, grid_thw=facts.grid_thw,
                                  num_tokens=facts.num_tokens,
                                  second_per_grid_t=facts.second_per_grid_t,
                                  frame_seconds=facts.frame_seconds))  # fmt: skip

    def learn(self, message: MediaUuid) -> None:
        """What another API process remembered (never shared again)."""
        facts = RememberedMedia(tuple(message.grid_thw), message.num_tokens,
                                message.second_per_grid_t, tuple(message.frame_seconds))  # fmt: skip
        key = (message.cache_salt, message.uuid, message.processing)
        self._store(key, message.modality, facts)

    def _store(
        self, key: tuple[str | None, str, str], modality: Modality, facts: RememberedMedia
    ) -> None:
        with self._lock:
            self._items[key] = (modality, facts)
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def lookup(
        self,
        uuid: str,
        modality: Modality,
        salt: str | None,
        *,
        param: str,
        scopes: Mapping[Modality, str] = _NO_SCOPES,
    ) -> RememberedMedia:
        """The facts of `uuid` sent as `modality` under its kind's preprocessing digest in
        `scopes`; a uuid sent as another kind (under that kind's digest) is told so."""
        processing = scopes.get(modality, "")
        key = (salt, uuid, processing)
        with self._lock:
            entry = self._items.get(key)
            if entry is not None:
                self._items.move_to_end(key)
            else:  # sent as the other kind, perhaps: remembered under that kind's digest
                others = (self._items.get((salt, uuid, scope)) for kind, scope in scopes.items()
                          if kind is not modality)  # fmt: skip
                entry = next((found for found in others if found is not None), None)
        if entry is None:
            # the salt or the kwargs may be what differs (fuzz73): both are named
            why = (f"send the {modality.value} with its uuid first, under the same "
                   "cache_salt and mm_processor_kwargs")  # fmt: skip
            raise unknown_media_uuid(uuid, why, param=param)
        known_modality, facts = entry
        if known_modality is not modality:
            raise MediaError(
                f"media uuid {uuid!r} names {known_modality.value}, not {modality.value}",
                param=param,
            )
        # Named here, used everywhere: with several API processes the others kept it as
        # least recently used, and forgot it first (fuzz51).
        self._tell_the_others(uuid, salt, processing, modality, facts)
        return facts


class RememberedMedia(NamedTuple):
    """What a uuid-only part needs of the media last sent under its uuid."""

    grid_thw: tuple[int, int, int]
    num_tokens: int
    second_per_grid_t: float
    frame_seconds: tuple[float, ...] = ()


UUIDS = UuidRegistry()


async def prepare_chat_prompt(
    request: ChatCompletionRequest,
    processor: PromptProcessor,
    fetcher: MediaFetcher | None,
    *,
    max_images: int,
    settings: Any = None,
    max_prompt_tokens: int | None = None,
    max_model_len: int | None = None,
    remember_uuids: bool = True,
) -> PreparedPrompt:
    """Fetch + process images and videos, check feature parts (none may have more tokens
    than `max_model_len`), and tokenise the rendered chat (refused before tokenising if
    it cannot fit in `max_prompt_tokens`). `remember_uuids` False: media sent with a uuid
    is not remembered under it (a prompt only counted, never sent to the engine, whose
    uuid would name an encoding the engine never made)."""
    if request.continue_final_message:  # a 400 before any media is fetched
        final_message_text(messages_as_dicts(request.messages))
    parts = media_parts(request.messages)
    pixel_parts = [p for p in parts if not p.is_feature]
    if len(parts) > max_images:
        raise InvalidRequest(
            f"the request has {len(parts)} media items; at most {max_images} are allowed",
            param="messages",
        )
    if pixel_parts and fetcher is None:
        first = pixel_parts[0]
        raise InvalidRequest(
            f"this model does not accept {first.modality.value}s", param=first.param
        )
    features = [p for p in parts if p.is_feature]
    policy = FeaturePolicy.from_settings(settings) if features else None
    for part in features:
        policy.check(part)  # type: ignore[union-attr]
        if max_model_len is not None:
            policy.check_fits(part, max_model_len)  # type: ignore[union-attr]
        if processor.timestamped_video_frames and part.modality is Modality.VIDEO:
            _check_frame_seconds(part)
    processing = fetcher.processing_for(request.mm_processor_kwargs) if pixel_parts else None
    processed = await _load_media(pixel_parts, fetcher, processing)
    scopes = _uuid_scopes(processing) if processing is not None else {}
    media, tensors, counts = [], [], []  # counts: (modality, tokens[, frame times])
    for part in parts:
        frame_seconds: tuple[float, ...] = ()
        if part.is_feature:
            grid = part.grid_thw
            url_hash = hashlib.blake2b(part.url.encode(), digest_size=16).hexdigest()  # type: ignore[union-attr]
            item = MediaInput(
                modality=part.modality,
                content_hash="feature-url:" + url_hash,
                offset=0,
                num_tokens=policy.num_tokens(grid),  # type: ignore[union-attr, arg-type]
                grid_thw=grid,  # type: ignore[arg-type]
                feature=FeatureSource(part.url),  # type: ignore[arg-type]
                second_per_grid_t=part.second_per_grid_t or policy.default_second_per_grid_t,  # type: ignore[union-attr]
            )
            if processor.timestamped_video_frames:
                frame_seconds = part.frame_seconds
        else:
            item, frame_seconds = _pixel_input(part, processed.get(part.param), tensors,
                                               request.cache_salt, scopes, remember_uuids)  # fmt: skip
        media.append(item)
        count = (item.modality.value, item.num_tokens)
        counts.append((*count, frame_seconds) if frame_seconds else count)
    plan = request.tool_plan
    prompt = await asyncio.to_thread(
        processor.process_chat,
        arguments_as_objects(messages_as_dicts(request.messages)),
        counts,
        tools=plan.tools if plan else None,
        max_tokens=max_prompt_tokens,
        **request.template_options,
    )
    media, tensors = place_media(media, prompt.spans, tensors)
    params = tuple(parts[span.item].param for span in prompt.spans)  # one per placed item
    return PreparedPrompt(
        token_ids=prompt.token_ids, media=media, tensors=tensors, media_params=params
    )


def _check_frame_seconds(part: MediaPart) -> None:
    """The model writes each temporal patch's time into the prompt: a video_features part
    must say them, one per temporal patch."""
    num_patches = part.grid_thw[0]  # type: ignore[index]
    if len(part.frame_seconds) != num_patches:
        raise InvalidRequest(
            "this model writes each temporal patch's time into the prompt: video_features "
            f"need frame_seconds, one time per temporal patch ({num_patches} for grid_thw "
            f"{list(part.grid_thw)}), got {len(part.frame_seconds)}; `tessera "  # type: ignore[arg-type]
            "encode-features` prints them",
            param=part.param + ".frame_seconds",
        )


async def _load_media(
    parts: list[MediaPart], fetcher: MediaFetcher | None, processing: MediaProcessing | None
) -> dict[str, ProcessedImage]:
    with_url = [p for p in parts if p.url is not None]
    if not with_url:
        return {}
    load = functools.partial(
        fetcher.load,  # type: ignore[union-attr]
        processing=processing,
        owner=object(),  # this request's parts take turns with others' for decode threads
    )
    tasks = [asyncio.create_task(load(p.url, p.modality.value, param=p.param)) for p in with_url]  # type: ignore[arg-type]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return {p.param: image for p, image in zip(with_url, results, strict=True)}


def _uuid_scopes(processing: MediaProcessing) -> dict[Modality, str]:
    """What a uuid of each kind is remembered under besides its salt: the preprocessing
    settings of its own kind, as a digest (it travels to the other API processes). Both
    kinds' together made an image uuid unknown when only a request's `fps` changed."""
    return {
        modality: hashlib.blake2b(
            f"{modality.value}:{processing.cache_tag(modality.value)}".encode(), digest_size=8
        ).hexdigest()
        for modality in (Modality.IMAGE, Modality.VIDEO)
    }


def _pixel_input(
    part: MediaPart,
    image: ProcessedImage | None,
    tensors: list[Any],
    salt: str | None,
    scopes: Mapping[Modality, str],
    remember_uuid: bool = True,
) -> tuple[MediaInput, tuple[float, ...]]:
    """MediaInput of a processed image or video (`image`), or of a uuid-only part (None),
    and for a video when each temporal patch was shot. A uuid is known only to requests
    of the same `cache_salt`."""
    if image is None:  # uuid only: the engine must hold the encoding already
        known = UUIDS.lookup(part.uuid, part.modality, salt, param=part.param, scopes=scopes)  # type: ignore[arg-type]
        return MediaInput(
            modality=part.modality,
            content_hash="uuid:" + part.uuid,  # type: ignore[operator]
            offset=0,
            num_tokens=known.num_tokens,
            grid_thw=known.grid_thw,
            second_per_grid_t=known.second_per_grid_t,
        ), known.frame_seconds
    content_hash = image.content_hash
    if part.uuid is not None:
        content_hash = "uuid:" + part.uuid
        if remember_uuid:
            UUIDS.remember(part.uuid, part.modality, salt, image, scopes.get(part.modality, ""))
    item = media_input(part.modality, image, len(tensors), content_hash)
    tensors.append(image.pixel_levels)  # [num_patches, C * T * P * P] uint8
    return item, image.frame_seconds
