"""Chat rendering, tokenizer and placeholder expansion for one model folder (the chat
template itself: engine/multimodal/chat_template.py).

The chat template renders one `<|image_pad|>` (or `<|video_pad|>`) per media item; once
the items are processed and their token counts known, `expand_placeholders` widens each
single placeholder into that many copies and records where each item's span starts:

    rendered:  ... <|vision_start|> <|image_pad|> <|vision_end|> ...
    expanded:  ... <|vision_start|> <|image_pad|> x num_tokens <|vision_end|> ...
                                    ^ PlaceholderSpan.offset
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from engine.errors import ContextLengthExceeded, InvalidRequest, MediaError, ModelLoadError
from engine.model_config import is_qwen3_vl
from engine.multimodal.chat_template import (
    compile_template,
    find_chat_template,
    read_json,
    render_template,
    takes_content_parts,
    template_for_request,
)
from engine.multimodal.messages import normalize_messages

MODALITIES = ("image", "video")
# A token covers at most its vocabulary entry's length of text (byte-level entries: one
# character a byte), so a text of C characters has at least C / longest-entry tokens. A
# normalizer may shrink the text before it is split (NFC composes up to three characters
# into one): with one, the bound is loosened by this factor.
NORMALIZER_SLACK = 4
# Texts longer than this are tokenised off the event loop (server/jobs.py): ~30 µs inline
# for a short prompt, against ~1.5 ms a 100k-character one would hold the loop.
INLINE_TOKENIZE_CHARS = 100_000


@dataclass(frozen=True)
class PlaceholderSpan:
    """Where one media item's placeholder tokens sit in a prompt (or, for a video laid out
    frame by frame, one temporal patch's: `frame` is its index, `item` the video's)."""

    modality: str  # "image" | "video"
    offset: int  # index in token_ids of the first placeholder token
    num_tokens: int
    item: int = 0  # which media item, in prompt order
    frame: int | None = None  # the temporal patch of a video laid out frame by frame


@dataclass(frozen=True)
class ProcessedPrompt:
    """Token ids with every media placeholder expanded; one span per item, in order; and
    for a chat, the text its template rendered (one placeholder token per item)."""

    token_ids: list[int]
    spans: list[PlaceholderSpan]
    text: str | None = None


class PromptProcessor:
    """Chat template + tokenizer for one model folder (tokenizer.json via the `tokenizers`
    library; chat template from chat_template.jinja / chat_template.json /
    tokenizer_config.json["chat_template"]). Thread-safe for concurrent use: it holds no
    mutable state after construction, and compiled templates are cached immutably.

    Token ids of the special tokens are None when the model does not have them (a
    text-only model has no image placeholder).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        *,
        special_tokens: dict[str, str | None] | None = None,
        eos_token_ids: list[int] | None = None,
        model_token_ids: dict[str, int] | None = None,
        timestamped_video_frames: bool = False,
        tool_chat_template: str | None = None,
    ):
        self.tokenizer = tokenizer
        # A checkpoint's "tool_use" named template: a chat with tools renders through it.
        self.tool_chat_template = tool_chat_template
        # Qwen3-VL: a video's placeholder becomes, per temporal patch, "<t seconds>" then
        # the patch's own <|vision_start|> pads <|vision_end|> (its processor's layout).
        self.timestamped_video_frames = timestamped_video_frames
        self.chat_template = chat_template
        if chat_template is not None:
            # Compiled now, not by the first requests: lru_cache does not stop threads that
            # miss at once from each compiling it (~10 ms of held GIL for a small template).
            # A broken template stays a per-request error (render_chat).
            with contextlib.suppress(jinja2.TemplateSyntaxError):
                compile_template(chat_template)
        self.special_tokens = dict(special_tokens or {})
        ids = dict(model_token_ids or {})

        def lookup(key: str, token: str) -> int | None:
            return ids.get(key, tokenizer.token_to_id(token))

        self.image_token_id = lookup("image_token_id", "<|image_pad|>")
        self.video_token_id = lookup("video_token_id", "<|video_pad|>")
        self.vision_start_token_id = lookup("vision_start_token_id", "<|vision_start|>")
        self.vision_end_token_id = lookup("vision_end_token_id", "<|vision_end|>")
        self.pad_token_id = self._token_id(self.special_tokens.get("pad_token"))
        self.bos_token_id = self._token_id(self.special_tokens.get("bos_token"))
        eos = list(eos_token_ids or [])
        tokenizer_eos = self.tokenizer_eos_token_id = self._token_id(
            self.special_tokens.get("eos_token")
        )
        if tokenizer_eos is not None:
            eos.append(tokenizer_eos)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))
        self.special_token_ids: frozenset[int] = frozenset(
            token_id
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.special
        )
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        longest_entry = max((len(token) for token in tokenizer.get_vocab()), default=1)
        slack = NORMALIZER_SLACK if tokenizer.normalizer is not None else 1
        # No text of more characters than this fits one token (see NORMALIZER_SLACK).
        self.max_chars_per_token: int = longest_entry * slack
        self._placeholder_kinds = {
            token_id: modality
            for modality, token_id in (
                ("image", self.image_token_id),
                ("video", self.video_token_id),
            )
            if token_id is not None
        }

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, chat_template: str | None = None
    ) -> PromptProcessor:
        """The folder's tokenizer and chat template; `chat_template` (a template's source,
        see `chat_template_from_setting`) replaces the folder's."""
        folder = Path(model_dir)
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise ModelLoadError("the model folder has no tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises bare Exception
            raise ModelLoadError("tokenizer.json could not be loaded") from exc
        tokenizer_config = read_json(folder / "tokenizer_config.json")
        special_tokens = {
            name: _token_content(tokenizer_config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        generation_config = read_json(folder / "generation_config.json")
        model_config = read_json(folder / "config.json")
        model_token_ids = {
            key: model_config[key]
            for key in (
                "image_token_id",
                "video_token_id",
                "vision_start_token_id",
                "vision_end_token_id",
            )
            if isinstance(model_config.get(key), int)
        }
        eos_ids = generation_config.get("eos_token_id", model_config.get("eos_token_id"))
        if isinstance(eos_ids, int):
            eos_ids = [eos_ids]
        return cls(
            tokenizer,
            chat_template or find_chat_template(folder, tokenizer_config),
            tool_chat_template=(
                None
                if chat_template
                else find_chat_template(folder, tokenizer_config, name="tool_use")
            ),
            special_tokens=special_tokens,
            eos_token_ids=[int(i) for i in eos_ids or []],
            model_token_ids=model_token_ids,
            timestamped_video_frames=is_qwen3_vl(model_config),
        )

    # ------------------------------------------------------------------ chat rendering

    def render_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render OpenAI-shaped messages through the chat template (the model's, or
        `chat_template` if given). Media parts become {"type": "image"} / {"type": "video"}
        so the template emits one placeholder per item. `continue_final_message` leaves the
        last message open (no end-of-turn after its text), so that the model carries on
        writing it: "prefilling" the start of an answer (transformers' meaning). Extra
        variables for the template come in `template_kwargs` (`chat_template_kwargs`)."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message continues the last message; it cannot be combined "
                "with add_generation_prompt, which starts a new one",
                param="continue_final_message",
            )
        template_source = (
            chat_template or (self.tool_chat_template if tools else None) or self.chat_template
        )
        if not template_source:
            raise InvalidRequest(
                "this model has no chat template; pass chat_template or use completions",
                param="chat_template",
            )
        template = template_for_request(template_source, template_kwargs or {})
        context = {name: value for name, value in self.special_tokens.items() if value is not None}
        context.update(template_kwargs or {})
        normalized = normalize_messages(
            messages,
            join_text=not takes_content_parts(template_source),
            developer_as_system="developer" not in template_source,
        )
        if continue_final_message:
            normalized = _tag_final_message(normalized)
        context.update(
            messages=normalized, tools=tools, add_generation_prompt=add_generation_prompt
        )
        text = render_template(template, context, request_template=chat_template is not None)
        if not continue_final_message:
            return text
        return _cut_at_tag(text, final_message_text(messages), len(normalized) - 1)

    # ------------------------------------------------------------------ tokens

    def encode(
        self, text: str, *, max_tokens: int | None = None, param: str = "messages"
    ) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised, no
        BOS/EOS is added. With `max_tokens`, a text too long to fit in that many tokens is
        refused before it is tokenised (`check_fits`)."""
        self.check_fits(text, max_tokens, param)
        return self._ids(text, add_special_tokens=False)

    def encode_prompt(
        self, text: str, *, max_tokens: int | None = None, param: str = "prompt"
    ) -> list[int]:
        """Token ids of a raw prompt (no chat template), with what the tokenizer adds around
        text: a Llama tokenizer's BOS (none for Qwen's), as transformers' `tokenizer(text)`
        and vLLM's completions do. A rendered chat is `encode`d: its template writes them."""
        self.check_fits(text, max_tokens, param)
        return self._ids(text, add_special_tokens=True)

    def check_fits(self, text: str, max_tokens: int | None, param: str) -> None:
        """Raises ContextLengthExceeded if `text` has more characters than `max_tokens`
        tokens can cover, so it surely does not fit (None: no bound). Tokenising a long
        text costs ~1.5 s a million tokens; a 60 MB body would cost a minute and a half."""
        if max_tokens is not None and len(text) > max_tokens * self.max_chars_per_token:
            raise ContextLengthExceeded(
                f"the prompt is {len(text):,} characters, more than this model's context of "
                f"{max_tokens} tokens can hold (no token covers more than "
                f"{self.max_chars_per_token} characters)",
                param=param,
            )

    def _ids(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # encode_batch lets go of the GIL while it works; encode holds it throughout (~3 s
        # for 2M tokens, when no other thread of the process runs: the event loop included).
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids, *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def expand_placeholders(
        self, token_ids: list[int], media_token_counts: list[tuple]
    ) -> ProcessedPrompt:
        """Replace the i-th placeholder token with `media_token_counts[i][1]` copies.

        Each entry is (modality, num_tokens) or, for a video, (modality, num_tokens,
        frame_seconds): with `timestamped_video_frames` such a video is laid out temporal
        patch by temporal patch, each after its time (one span per patch).

        The placeholders in `token_ids` must match the media items one for one, in kind and
        order; anything else (including placeholder tokens typed into a text prompt) is a
        `MediaError`.
        """
        kinds = self._placeholder_kinds
        positions = [i for i, token_id in enumerate(token_ids) if token_id in kinds]
        found = [kinds[token_ids[i]] for i in positions]
        given = [entry[0] for entry in media_token_counts]
        if found != given:
            raise MediaError(_mismatch_message(found, given), param="messages")
        output: list[int] = []
        spans: list[PlaceholderSpan] = []
        start = 0
        for index, (position, entry) in enumerate(zip(positions, media_token_counts, strict=True)):
            modality, num_tokens, *frames = entry
            if num_tokens < 1:
                raise MediaError(f"a {modality} must take at least one token", param="messages")
            output.extend(token_ids[start:position])
            frame_seconds = frames[0] if frames else ()
            if self.timestamped_video_frames and modality == "video" and frame_seconds:
                spans += self._timestamped_frames(output, index, num_tokens, frame_seconds)
            else:
                spans.append(PlaceholderSpan(modality, len(output), num_tokens, index))
                output.extend([token_ids[position]] * num_tokens)
            start = position + 1
        output.extend(token_ids[start:])
        return ProcessedPrompt(token_ids=output, spans=spans)

    def _timestamped_frames(
        self, output: list[int], item: int, num_tokens: int, frame_seconds: Sequence[float]
    ) -> list[PlaceholderSpan]:
        """Appends a video's temporal patches to `output` as Qwen3-VL's processor writes
        them (`<1.5 seconds><|vision_start|><|video_pad|>...<|vision_end|>` each); their
        spans."""
        per_frame, remainder = divmod(num_tokens, len(frame_seconds))
        if remainder or self.vision_start_token_id is None or self.vision_end_token_id is None:
            raise MediaError("the video's frames do not split its tokens", param="messages")
        spans = []
        for frame, seconds in enumerate(frame_seconds):
            output.extend(self.encode(f"<{seconds:.1f} seconds>"))
            output.append(self.vision_start_token_id)
            spans.append(PlaceholderSpan("video", len(output), per_frame, item, frame))
            output.extend([self.video_token_id] * per_frame)  # type: ignore[list-item]
            output.append(self.vision_end_token_id)
        return spans

    def process_chat(
        self,
        messages: list[dict],
        media_token_counts: list[tuple[str, int]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> ProcessedPrompt:
        """Render, tokenise and expand placeholders in one go; with `max_tokens`, a
        rendered chat too long for that many tokens is refused before it is tokenised."""
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        expanded = self.expand_placeholders(
            self.encode(text, max_tokens=max_tokens), media_token_counts
        )
        return replace(expanded, text=text)


def final_message_text(messages: list[dict]) -> str:
    """The text that `continue_final_message` carries on: the last message's content, or
    its last part, which must be text. Checked before any media is fetched."""
    index = len(messages) - 1
    content = messages[-1].get("content") if messages else None
    param = f"messages[{index}].content"
    if isinstance(content, list):
        if not content or content[-1].get("type") != "text":
            raise InvalidRequest(
                "continue_final_message continues the last message's text: its last part "
                "must be a text part",
                param=param,
            )
        content = content[-1].get("text")
    if not isinstance(content, str):  # empty or blank text continues, as in transformers
        raise InvalidRequest(
            "continue_final_message needs text in the last message to continue", param=param
        )
    return content


# Marks where the final message's text ends in the rendering (transformers' tag, so that
# a template that trims it trims it alike).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict]) -> list[dict]:
    """`messages` with CONTINUE_TAG after the last message's text (its last part's)."""
    final_message_text(messages)  # there is text to continue
    last = dict(messages[-1])
    content = last["content"]
    if isinstance(content, list):
        content = [*content[:-1], {**content[-1], "text": content[-1]["text"] + CONTINUE_TAG}]
    else:
        content = content + CONTINUE_TAG
    last["content"] = content
    return [*messages[:-1], last]


def _cut_at_tag(text: str, final_text: str, index: int) -> str:
    """`text` (a chat rendered with the final message tagged) up to the end of that
    message's text, where the template would close the turn, as transformers'
    `continue_final_message` cuts it: where the tag kept its blank, the text kept its
    trailing blanks; else the template trimmed them. (The text itself was looked for: a
    prefill that also occurs in the turn's end, "e" in `<|im_end|>`, was cut after that.)"""
    at = text.rfind(CONTINUE_TAG.strip())
    if at < 0 or final_text.strip() not in text:
        raise InvalidRequest(
            "continue_final_message: the chat template does not write the last message's "
            "text as it was given, so it cannot be continued",
            param=f"messages[{index}].content",
        )
    if text.startswith(CONTINUE_TAG, at):
        return text[:at]
    return text[:at].rstrip()


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _mismatch_message(found: list[str], given: list[str]) -> str:
    for modality in MODALITIES:
        num_found, num_given = found.count(modality), given.count(modality)
        if num_found != num_given:
            verb = "was" if num_given == 1 else "were"
            hint = ""
            if num_found < num_given:  # a tool message's image, say, under Qwen2-VL's template
                hint = "; the chat template writes no placeholder for media in some messages"
            return (
                f"the prompt has {_plural(num_found, modality + ' placeholder')} "
                f"but {_plural(num_given, modality)} {verb} given{hint}"
            )
    return (
        f"the media items ({', '.join(given)}) are not in the order of the prompt's "
        f"placeholders ({', '.join(found)})"
    )


def _token_content(token: Any) -> str | None:
    if isinstance(token, dict):  # older tokenizer_config.json: {"content": "...", ...}
        token = token.get("content")
    return token if isinstance(token, str) else None
