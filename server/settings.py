"""Server settings: one frozen dataclass, loaded from CLI flags, env vars, YAML and defaults.

Precedence, highest first:

    --max-num-seqs 8                   CLI flag (every field has one, generated below)
    TESSERA_MAX_NUM_SEQS=8             environment variable (TESSERA_ + field name upper-cased)
    max_num_seqs: 8                    YAML file given by --config FILE (or TESSERA_CONFIG)
    EngineConfig / ServerSettings      dataclass defaults

Engine fields (engine/config.py) and server fields share one flat namespace: YAML keys are
field names, engine fields at the top level (an `engine:` mapping is accepted too). Flags
are generated from the dataclass fields so they never drift; booleans get `--x/--no-x`.
Without a model anywhere, `model` is the built-in tiny checkpoint's folder
(server/default_model.py), which `tessera serve` generates on first use.

`host` defaults to 0.0.0.0 (all interfaces) like most serving daemons and what a container
needs; pass `--host 127.0.0.1` on a shared machine, and set `api_key` whenever the port is
reachable by others (the server warns at start-up when it is not set).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import io
import os
import re
import tokenize
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, check_ranges
from engine.generation_defaults import SamplingDefaults
from engine.logging_utils import LOG_FORMATS, LOG_LEVELS
from engine.multimodal.chat_template import chat_template_from_setting
from server.field_limits import DEFAULT_FIELD_LIMITS, FieldLimits
from server.host_defaults import (
    default_api_server_count,
    default_image_decode_threads,
    usable_cores,
)
from server.reasoning import REASONING_PARSERS
from server.settings_yaml import read_yaml_mapping
from server.tool_calls import TOOL_CALL_PARSERS

ENV_PREFIX = "TESSERA_"
CONFIG_ENV = "TESSERA_CONFIG"
# TESSERA_* variables that are not settings: the default model's cache, and the install
# and launch scripts' own (scripts/install.sh, scripts/serve.sh, the Dockerfile).
OTHER_ENV = frozenset({CONFIG_ENV, "TESSERA_CACHE_DIR", "TESSERA_VENV", "TESSERA_TORCH",
                       "TESSERA_TORCH_INDEX"})  # fmt: skip
MIN_HEADER_BYTES = 1024  # a request line and the headers of any ordinary client
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("none", "null")
MAX_API_SERVERS = 64
_LIMITS = DEFAULT_FIELD_LIMITS  # the request field limits (server/field_limits.py)


class SettingsError(ValueError):
    """A setting is unknown, mistyped or out of range. The message names the setting and
    where it came from (flag, env var or YAML file). `settings`: the ones at fault, where
    the message's words would name others too ("the model's ...")."""

    def __init__(self, message: str, settings: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.settings = settings


@dataclass(frozen=True)
class ServerSettings:
    """Everything `tessera serve` needs: the engine's config plus the HTTP server's."""

    engine: EngineConfig
    host: str = "0.0.0.0"  # all interfaces (containers); 127.0.0.1 for local only
    port: int = 8000  # HTTP port
    api_key: str | None = None  # Bearer key required on /v1/*, /tokenize, /detokenize and /openapi.json; None = no auth
    log_level: str = "info"  # debug | info | warning | error
    log_format: str = "text"  # "text" | "json" (one JSON object per line)
    max_request_body_bytes: int = 64 * 1024 * 1024  # larger bodies get 413
    max_request_json_containers: int = 500_000  # JSON objects and arrays in a body, counted before it is parsed (the parse holds the event loop: 5 M small arrays took 3 s); more get 413; no text a context holds has that many braces
    max_image_bytes: int = 20 * 1024 * 1024  # per fetched / data: image
    max_images_per_request: int = 16  # media parts (images, videos, features) in one request
    max_image_pixels: int = 64_000_000  # an image's, and each video frame's, checked before decoding (decompression bombs)
    max_video_bytes: int = 64 * 1024 * 1024  # per fetched / data: video
    video_fps: float = 2.0  # video frames sampled per second (as transformers' `fps`)
    max_video_frames: int = 32  # frames sampled per video, at most (2 frames = 1 grid step)
    max_video_tokens: int = 16384  # frames shrink so that one video takes at most ~0.9x this many tokens
    max_video_decode_seconds: float = 30.0  # a video still decoding after this is refused (400)
    image_cache_mb: int = 256  # processed images kept for repeats of the same bytes; 0 = off
    image_decode_threads: int | None = None  # threads that decode and preprocess images, per API process; None = half the cores shared among the API processes, 2 to 8 (a burst of image requests queues on them)
    video_decode_threads: int = 2  # their own threads for videos: an image never waits behind one
    media_fetch_timeout_s: float = 10.0  # total deadline per media URL
    media_fetch_max_redirects: int = 3  # each hop re-checked by the URL guard
    media_fetch_max_connections: int = 256  # open media downloads per API process
    media_fetch_max_connections_per_host: int = 64  # so that one slow host cannot take them all
    allow_private_media_urls: bool = False  # allow image URLs on loopback / private networks
    allowed_media_domains: str | None = None  # comma-separated host allowlist; None = any
    allowed_local_media_path: str | None = None  # file:// image URLs only under this folder (it must exist)
    max_waiting_requests: int = 256  # beyond max_num_seqs running; more -> 503 + Retry-After
    max_waiting_tokens: int = 1_000_000  # prompt tokens of all admitted unfinished requests
    max_feature_requests: int = 256  # requests with s3:// or http(s):// features to download, admitted apart from the two above (a slow store holds each of their downloads up to three times feature_fetch_timeout_s: waits for a connection and for room, then the download; they must not refuse the requests that need none); more -> 503
    trust_request_chat_template: bool = False  # accept a request's own `chat_template`
    chat_template: str | None = None  # a Jinja chat template over the model's: a file, or the template itself (vLLM's --chat-template)
    tool_call_parser: str = "auto"  # "auto" (from the chat template) | "hermes" (<tool_call> blocks: Qwen2.5) | "llama3_json" ({"name", "parameters"}: Llama 3.1)
    reasoning_parser: str = "auto"  # "auto" (qwen3 when the chat template writes <think>) | "qwen3" (<think>...</think> becomes reasoning_content) | "none"
    generation_config: str = "auto"  # sampling defaults for fields a request leaves out: "auto" = the model folder's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps max_tokens), as vLLM; "none" = OpenAI's; or a folder holding one
    override_generation_config: str | None = None  # JSON object laid over those defaults, e.g. '{"temperature": 0.5}'
    engine_startup_timeout_s: float = 600.0  # model load + KV allocation deadline
    shutdown_timeout_s: float = 30.0  # drain in-flight requests on SIGTERM, then stop
    api_server_count: int | None = None  # processes that parse requests, preprocess media and stream tokens for one engine; None = on a GPU a quarter of the usable cores, 1 to 4 (that work bounds serving there), else 1 (docs/deploy.md)
    engine_inbox_address: str | None = None  # tcp://HOST:PORT; None = private ipc:// socket
    engine_outbox_address: str | None = None  # set together with engine_inbox_address
    max_n: int = 16  # choices one request may ask for (n); each is a sequence of its own in the batch and in the admission budget
    max_messages: int = _LIMITS.max_messages  # messages in one chat (or Responses input items, or /tokenize chat)
    max_content_parts: int = _LIMITS.max_content_parts  # content parts of all of a chat's messages together
    max_tools: int = _LIMITS.max_tools  # tools in one request, and tool calls in one message
    max_stop_strings: int = _LIMITS.max_stop_strings  # stop strings in one request
    max_stop_string_chars: int = _LIMITS.max_stop_string_chars  # characters of each stop string, bad word and structured-output choice
    max_stop_token_ids: int = _LIMITS.max_stop_token_ids  # stop_token_ids in one request
    max_bad_words: int = _LIMITS.max_bad_words  # bad_words in one request
    max_logit_bias_tokens: int = _LIMITS.max_logit_bias_tokens  # tokens one logit_bias may bias (OpenAI's limit)
    max_prompts_per_request: int = _LIMITS.max_prompts_per_request  # prompts in one /v1/completions batch
    max_request_chat_template_chars: int = _LIMITS.max_request_chat_template_chars  # a request's own chat_template (with trust_request_chat_template)
    max_structured_output_choices: int = _LIMITS.max_structured_output_choices  # structured_outputs.choice entries
    max_structured_output_regex_chars: int = _LIMITS.max_structured_output_regex_chars  # structured_outputs.regex characters
    max_structured_output_schema_chars: int = _LIMITS.max_structured_output_schema_chars  # a JSON schema's characters, as JSON (response_format, structured_outputs.json, tools' parameters together)
    max_structured_output_grammar_chars: int = _LIMITS.max_structured_output_grammar_chars  # structured_outputs.grammar characters (Lark or GBNF)
    max_remembered_media_uuids: int = 16384  # media uuids each API process remembers for uuid-only parts (the least recently used forgotten first: naming it again is a 400)
    stream_interval: int = 1  # new tokens a streamed chunk waits for after the first (vLLM's and SGLang's --stream-interval): more cost the API process less per token and make chunks coarser
    timeout_keep_alive_s: int = 65  # an idle kept-alive HTTP connection closes after this: above the idle timeouts of the clients' pools (httpx and the openai client 5 s, aiohttp 15 s) and of common proxies (AWS ALB, nginx: 60 s), so that they close first; the server closing one as a client reuses it loses that request (uvicorn's and vLLM's 5 s matched httpx's)
    request_read_timeout_s: float = 30.0  # a request's header block, and each wait for more of its body, must come within this (else the connection closes, or 408)
    request_body_min_rate: float = 240.0  # bytes a second a request body must average once request_read_timeout_s has passed (else 408; a floor like ASP.NET Kestrel's MinRequestBodyDataRate, whose default it takes): a body trickled a byte at a time held its connection for days; 0 = no floor
    write_timeout_s: float = 60.0  # a response whose client takes none of it for this long (every buffer between full) ends as a disconnect: its connection aborted, its requests' room given back; 0 = never
    max_header_bytes: int = 64 * 1024  # request line + headers; over it: 431 (at least 1024)
    enable_feature_inputs: bool = False  # accept image_features / video_features parts
    allowed_feature_buckets: str | None = None  # comma-separated S3 buckets; None = any

    def __post_init__(self) -> None:
        if self.api_key is not None:
            # A key read from a file ends in a newline no client sends; an empty one (an
            # optional Secret left empty) is no key, and `tessera serve` warns of that.
            object.__setattr__(self, "api_key", self.api_key.strip() or None)
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()):
            # HTTP carries header values as bytes that servers read as Latin-1: a client
            # cannot send a key with other characters so that it compares equal.
            raise SettingsError("api_key must be printable ASCII (it travels in an HTTP header)")
        if self.log_format not in LOG_FORMATS:
            raise SettingsError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise SettingsError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser not in REASONING_PARSERS:
            raise SettingsError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.log_level.lower() not in LOG_LEVELS:
            raise SettingsError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port must be in 0..65535, got {self.port}")
        try:
            check_ranges(
                self,
                positive=("max_request_body_bytes", "max_request_json_containers", "max_image_bytes", "max_video_bytes",
                          "max_header_bytes", "max_video_frames", "max_video_tokens",
                          "image_decode_threads", "video_decode_threads", "stream_interval",
                          "media_fetch_max_connections", "media_fetch_max_connections_per_host",
                          "video_fps", "media_fetch_timeout_s", "request_read_timeout_s",
                          "timeout_keep_alive_s", "shutdown_timeout_s", "max_waiting_tokens",
                          "max_feature_requests",
                          "max_video_decode_seconds", "max_image_pixels",
                          "engine_startup_timeout_s", "max_n", "max_remembered_media_uuids",
                          *(field.name for field in dataclasses.fields(FieldLimits))),
                non_negative=("max_waiting_requests", "max_images_per_request", "write_timeout_s",
                              "request_body_min_rate",
                              "image_cache_mb", "media_fetch_max_redirects"),
            )  # fmt: skip
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if self.max_header_bytes < MIN_HEADER_BYTES:  # every request, /health too, was a 431
            raise SettingsError(
                f"max_header_bytes must be at least {MIN_HEADER_BYTES}, got {self.max_header_bytes}"
            )
        if self.allowed_local_media_path:  # empty: unset, as in vLLM
            folder = Path(self.allowed_local_media_path).expanduser()
            # kept expanded: the media fetcher resolves it as given (fuzz66)
            object.__setattr__(self, "allowed_local_media_path", str(folder))
            if not folder.exists():
                raise SettingsError(
                    f"allowed_local_media_path {self.allowed_local_media_path!r} does not exist"
                )
            if not folder.is_dir():
                raise SettingsError(
                    f"allowed_local_media_path {self.allowed_local_media_path!r} is not a folder"
                )
        if 0 < self.write_timeout_s < 1:  # a check every quarter of it, per paused connection
            raise SettingsError(f"write_timeout_s must be 0 (never) or at least 1, got {self.write_timeout_s}")
        if (self.engine_inbox_address is None) != (self.engine_outbox_address is None):
            raise SettingsError("set both engine_inbox_address and engine_outbox_address, or none")
        for name in ("engine_inbox_address", "engine_outbox_address"):
            address = getattr(self, name)
            tcp = re.fullmatch(r"tcp://\S+:(\d{1,5})", address or "")
            if address is not None and not (
                (tcp and 1 <= int(tcp.group(1)) <= 65535) or re.fullmatch(r"ipc://\S+", address)
            ):  # ZMQ takes port 99999 as some other port
                raise SettingsError(
                    f"{name} must be tcp://HOST:PORT or ipc://PATH, got {address!r}"
                )
        if self.api_server_count is None:
            count = 1  # an engine at given addresses takes one API process
            if self.engine_inbox_address is None:
                count = default_api_server_count(self.engine.device, usable_cores())
            object.__setattr__(self, "api_server_count", count)
        if not 1 <= self.api_server_count <= MAX_API_SERVERS:
            raise SettingsError(
                f"api_server_count must be in 1..{MAX_API_SERVERS}, got {self.api_server_count}"
            )
        if self.api_server_count > 1 and self.engine_inbox_address is not None:
            raise SettingsError(
                "api_server_count > 1 connects its processes over private ipc:// sockets; "
                "unset engine_inbox_address and engine_outbox_address"
            )

    @property
    def model_name(self) -> str:
        """The model name clients use (`served_model_name` or the model folder's name)."""
        return self.engine.model_name

    def image_decode_thread_count(self) -> int:
        """`image_decode_threads`, or its default for this machine's usable cores."""
        if self.image_decode_threads is not None:
            return self.image_decode_threads
        return default_image_decode_threads(usable_cores(), self.api_server_count)

    def replace(self, **changes: Any) -> ServerSettings:
        return dataclasses.replace(self, **changes)

    def sampling_defaults(self) -> SamplingDefaults:
        """What `generation_config` and `override_generation_config` name (reads the
        model folder; GenerationConfigError if unusable)."""
        return SamplingDefaults.load(
            self.generation_config, self.engine.model, self.override_generation_config
        )

    def chat_template_source(self) -> str | None:
        """`chat_template`'s source, read and syntax-checked (ChatTemplateError if
        unusable); None = the model's own."""
        if self.chat_template is None:
            return None
        return chat_template_from_setting(self.chat_template)


@dataclass(frozen=True)
class _Field:
    name: str
    type: type  # str, int, float or bool
    is_optional: bool
    is_engine: bool
    default: Any

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def _fields_of(cls: type, *, is_engine: bool) -> list[_Field]:
    hints = typing.get_type_hints(cls)
    result = []
    for field in dataclasses.fields(cls):
        if field.name == "engine":
            continue
        hint = hints[field.name]
        args = typing.get_args(hint)
        is_optional = type(None) in args
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            (hint,) = [arg for arg in args if arg is not type(None)]
        default = None if field.default is dataclasses.MISSING else field.default
        result.append(_Field(field.name, hint, is_optional, is_engine, default))
    return result


def _field_comments(cls: type) -> dict[str, str]:
    """The trailing `# comment` of each field in the class source: the one place a setting
    is described, shown by `--help` and in docs/configuration.md."""
    comments: dict[str, str] = {}
    line_to_name: dict[int, str] = {}
    source = inspect.getsource(cls)
    for number, line in enumerate(source.splitlines(), start=1):
        head = line.strip().split(":", 1)[0]
        if head.isidentifier() and line.startswith("    ") and not line.startswith("     "):
            line_to_name[number] = head
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        name = line_to_name.get(token.start[0])
        if token.type == tokenize.COMMENT and name:
            comments[name] = token.string.lstrip("#").strip()
    return comments


FIELDS: dict[str, _Field] = {
    f.name: f
    for f in _fields_of(EngineConfig, is_engine=True) + _fields_of(ServerSettings, is_engine=False)
}
DESCRIPTIONS: dict[str, str] = {**_field_comments(EngineConfig), **_field_comments(ServerSettings)}


def _parse_text(field: _Field, text: str, source: str) -> Any:
    """A flag or env value (a string) -> the field's type."""
    if field.is_optional and text.strip().lower() in _NONE:
        return None
    try:
        if field.type is bool:
            lowered = text.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError
        return field.type(text)
    except ValueError:
        raise SettingsError(
            f"{source}: expected {field.type.__name__} for {field.name}, got {text!r}"
        ) from None


def _check_yaml_value(field: _Field, value: Any, source: str) -> Any:
    if field.is_optional and (
        value is None or (isinstance(value, str) and value.strip().lower() in _NONE)
    ):
        return None  # `none` means unset, as in a flag or an environment variable
    expected = field.type
    is_ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not is_ok:
        raise SettingsError(
            f"{source}: expected {expected.__name__} for {field.name}, got {value!r}"
        )
    return value


def build_parser(prog: str = "tessera serve") -> argparse.ArgumentParser:
    """The `serve` flags: --config plus one flag per settings field."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a vision-language model over an OpenAI-compatible HTTP API.",
        argument_default=argparse.SUPPRESS,  # absent flags stay absent: env/YAML may set them
        allow_abbrev=False,  # a flag added later must not change what a script's short form means
    )
    parser.add_argument("--config", help=f"YAML settings file (env {CONFIG_ENV})")
    for field in FIELDS.values():
        default = "the built-in tiny model" if field.name == "model" else field.default
        description = DESCRIPTIONS.get(field.name, "")
        help_text = f"{description} (default {default}; env {field.env})".lstrip()
        if field.type is bool:
            parser.add_argument(field.flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            metavar = field.type.__name__.upper() + ("|none" if field.is_optional else "")
            parser.add_argument(field.flag, type=str, metavar=metavar, help=help_text)
    return parser


def _from_yaml(path: str) -> dict[str, Any]:
    try:
        data = read_yaml_mapping(path)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    nested = data.pop("engine", None)
    nested = {} if nested is None else nested  # `engine:` with nothing under it
    if not isinstance(nested, dict):
        raise SettingsError(f"{path}: 'engine' must be a mapping")
    result: dict[str, Any] = {}
    for key, value in [*data.items(), *nested.items()]:
        field = FIELDS.get(key) if isinstance(key, str) else None
        if field is None or (key in nested and not field.is_engine):
            known = ", ".join(sorted(FIELDS))
            raise SettingsError(f"{path}: unknown setting {key!r} (known settings: {known})")
        if key in result:
            raise SettingsError(f"{path}: {key!r} is set twice")
        result[key] = _check_yaml_value(field, value, path)
    return result


def unknown_environment_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each TESSERA_* variable that is no setting: a typo in YAML or on the
    command line is an error, and one in the environment was ignored without a word."""
    known = {field.env for field in FIELDS.values()} | OTHER_ENV
    warnings = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"ignoring the environment variable {name}: it is no setting{hint}")
    return warnings


def load_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServerSettings:
    """Settings from CLI flags > TESSERA_* env vars > YAML (--config) > defaults.
    Raises SettingsError (argparse exits on a malformed command line)."""
    environ = os.environ if environ is None else environ
    values, sources = _read_values(argv, environ)
    if "model" not in values:
        from server.default_model import default_model_dir

        values["model"] = str(default_model_dir(environ))
    engine_values = {k: v for k, v in values.items() if FIELDS[k].is_engine}
    server_values = {k: v for k, v in values.items() if not FIELDS[k].is_engine}
    try:
        return ServerSettings(engine=EngineConfig(**engine_values), **server_values)
    except (TypeError, ValueError) as exc:
        message = str(exc) if isinstance(exc, SettingsError) else f"invalid settings: {exc}"
        raise SettingsError(naming_sources(message, sources)) from None


def setting_sources(argv: Sequence[str] | None, environ: Mapping[str, str]) -> dict[str, str]:
    """Where each setting given came from (its flag, variable or YAML file), for errors
    found after `load_settings`, such as the pre-flight's."""
    return _read_values(argv, environ)[1]


def _read_values(
    argv: Sequence[str] | None, environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings given, parsed, and where each came from."""
    flags = vars(build_parser().parse_args(list(argv if argv is not None else [])))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    config_path = flags.pop("config", None) or environ.get(CONFIG_ENV)
    if config_path:
        values.update(_from_yaml(config_path))
        sources.update(dict.fromkeys(values, config_path))
    for field in FIELDS.values():
        if field.env in environ:
            values[field.name] = _parse_text(field, environ[field.env], field.env)
            sources[field.name] = field.env
    for name, value in flags.items():
        field = FIELDS[name]
        values[name] = value if field.type is bool else _parse_text(field, value, field.flag)
        sources[name] = field.flag
    return values, sources


def naming_sources(
    message: str, sources: Mapping[str, str], settings: Sequence[str] = ()
) -> str:
    """`message` with where each setting it names came from: a range error named the
    setting alone, and left the user to find whether a flag, an environment variable or
    the YAML file had set it (fuzz51)."""
    named = [name for name in sources
             if name in settings or not settings and re.search(rf"\b{name}\b", message)]  # fmt: skip
    if not named:
        return message
    return f"{message} (set by {', '.join(sources[name] for name in named)})"


if __name__ == "__main__":  # the reference: python -m server.settings > docs/configuration.md
    from server.settings_docs import configuration_markdown

    print(configuration_markdown(), end="")
