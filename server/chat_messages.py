"""What a chat request carries: its messages, their content parts (text, images, videos,
pre-encoded features), earlier tool calls, and its tools; and the base of every request
model. `server/openai_models.py` builds the request bodies from them.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.multimodal.messages import (
    FUNCTION_ROLE_REFUSED,
    content_rule_broken,
    refusals_as_text,
)
from server.field_limits import bounded, check_count

# Limits OpenAI's API or the model's shapes fix; the others are settings (field_limits.py).
MAX_TOOL_NAME_CHARS = 64
MAX_FRAME_SECONDS = 4096  # video_features.frame_seconds: temporal patches of one video
# ... and each one's time: a week of video. 1e300 wrote a 300-digit number into the prompt.
MAX_VIDEO_TIME_S = 7 * 24 * 3600.0

# A JSON integer: pydantic's lax ints read `true` as 1, "6" as 6 and 6.0 as 6 (a token id,
# a grid size).
StrictInt = Annotated[int, Strict()]
TokenId = StrictInt


class RequestModel(BaseModel):
    """A request body's model: unknown fields are ignored, as OpenAI ignores them. No float
    field takes NaN or an infinity (JSON's `NaN`, `Infinity`, or `1e400`): "should be a
    finite number", where a bound's message ("less than or equal to 2") did not say why
    (fuzz82)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ImageUrl(RequestModel):
    url: str
    detail: Literal["auto", "low", "high", "original"] | None = None  # OpenAI's; not used here


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class _UrlPart(RequestModel):
    """A media part fetched from a URL. With a client `uuid` the engine caches the encoding
    under it, and a later part may carry the uuid alone (its URL object omitted or "")."""

    url_field: ClassVar[str]
    uuid: str | None = Field(default=None, min_length=1, max_length=256)  # client's own id

    @model_validator(mode="before")
    @classmethod
    def _uuid_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("uuid") and data.get(cls.url_field) is None:
            return {**data, cls.url_field: {"url": ""}}
        return data

    @property
    def url(self) -> str:
        return getattr(self, self.url_field).url


class ImagePart(_UrlPart):
    url_field: ClassVar[str] = "image_url"
    type: Literal["image_url"]
    image_url: ImageUrl


class VideoUrl(RequestModel):
    url: str


class VideoPart(_UrlPart):
    """A video to decode and sample (`http(s)`, `data:` or allowed `file://` URL)."""

    url_field: ClassVar[str] = "video_url"
    type: Literal["video_url"]
    video_url: VideoUrl


class FeatureRef(RequestModel):
    url: str
    grid_thw: list[StrictInt]
    # Videos: seconds of video one temporal patch spans (vLLM's second_per_grid_ts; what
    # `tessera encode-features` prints). Qwen2.5-VL spaces video positions by it; default
    # temporal_patch_size / --video-fps, as for a video_url sampled by this server.
    second_per_grid_t: float | None = Field(default=None, gt=0.0)
    # Videos of models that write each temporal patch's time into the prompt (Qwen3-VL):
    # those times in seconds, one per temporal patch (what `tessera encode-features`
    # prints). Other models leave them out.
    frame_seconds: (
        list[Annotated[float, Field(ge=0.0, le=MAX_VIDEO_TIME_S)]] | None
    ) = Field(default=None, max_length=MAX_FRAME_SECONDS)


class ImageFeaturesPart(RequestModel):
    """Pre-encoded image features (server flag --enable-feature-inputs)."""

    type: Literal["image_features"]
    image_features: FeatureRef


class VideoFeaturesPart(RequestModel):
    """Pre-encoded video features (server flag --enable-feature-inputs)."""

    type: Literal["video_features"]
    video_features: FeatureRef


ContentPart = Annotated[
    TextPart | ImagePart | VideoPart | ImageFeaturesPart | VideoFeaturesPart,
    Field(discriminator="type"),
]


class FunctionCall(RequestModel):
    name: str = Field(max_length=MAX_TOOL_NAME_CHARS)
    # OpenAI sends JSON text; null is no arguments, as vLLM reads it (server/tool_calls.py)
    arguments: str | dict[str, Any] | None = "{}"


class ToolCallMessagePart(RequestModel):
    """A call an assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # None only on an assistant turn (one that made tool calls) or a tool's result, as in
    # OpenAI's API and vLLM's (fuzz99: a user's null content was an empty turn)
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallMessagePart] | None = None
    tool_call_id: str | None = None  # role "tool": the call this answers
    # An earlier answer's thinking, which templates such as Qwen3's write back into the
    # turns after the last user message (vLLM takes either name).
    reasoning_content: str | None = None
    reasoning: str | None = None

    _few_tool_calls = field_validator("tool_calls", mode="before")(
        bounded(count=("max_tools", "tool calls in one message"))
    )

    # The rules every message keeps, offline too (engine/multimodal/messages.py), checked
    # here so that the 400 comes before any media is fetched.
    @model_validator(mode="before")
    @classmethod
    def _no_function_role(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") == "function":
            raise ValueError(FUNCTION_ROLE_REFUSED)
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _refusals_as_text(cls, content: Any, info: ValidationInfo) -> Any:
        if info.data.get("role") != "assistant" or not isinstance(content, list):
            return content
        content = refusals_as_text("assistant", content)
        if any(isinstance(part, dict) and part.get("type") == "refusal" for part in content):
            raise ValueError("a refusal part needs its 'refusal' text")
        return content

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: Any, info: ValidationInfo) -> Any:
        broken = content_rule_broken(info.data.get("role"), content)
        if broken is not None:
            raise ValueError(broken)
        return content


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none = any object
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _function_tools_only(cls, data: Any) -> Any:
        # Before the fields: a `custom` tool was refused as missing 'tools[0].function'.
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"only function tools are supported, not {kind!r}")  # as /v1/responses
        return data


class NamedFunction(RequestModel):
    name: str = Field(max_length=MAX_TOOL_NAME_CHARS)


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


def few_enough_messages(messages: Any) -> Any:
    """A `mode="before"` check of a body's messages: at most `--max-messages`, with at most
    `--max-content-parts` content parts in all, counted before any is validated (pydantic
    would validate every item first: server/field_limits.py)."""
    if isinstance(messages, list):
        check_count(len(messages), "max_messages", "messages")
        num_parts = sum(
            len(message["content"])
            for message in messages
            if isinstance(message, dict) and isinstance(message.get("content"), list)
        )
        check_count(num_parts, "max_content_parts", "content parts in all messages")
    return messages


def some_messages(messages: Any) -> Any:
    """`few_enough_messages`, and at least one: a chat's (or a /tokenize chat's) `messages`
    (pydantic's own words for an empty list were "List should have at least 1 item after
    validation, not 0")."""
    if isinstance(messages, list) and not messages:
        raise ValueError("at least one message is needed")
    return few_enough_messages(messages)


few_enough_tools = bounded(count=("max_tools", "tools"))  # a body's tools, before validation
