"""The request fields that say how a chat is rendered into a prompt (vLLM's names), shared
by /v1/chat/completions and /tokenize; /v1/responses maps its own onto them
(server/responses.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from server.chat_messages import RequestModel
from server.field_limits import bounded

MAX_CHAT_TEMPLATE_KWARGS = 64
# OpenAI's `reasoning_effort` values, and vLLM's "max".
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatTemplateFields(RequestModel):
    """How a chat is rendered (vLLM's names): a generation prompt after the last message
    (the default), or `continue_final_message` to leave the last message open for the
    model to carry on, extra template variables in `chat_template_kwargs`, and a template of
    the request's own in `chat_template`. `reasoning_effort` reaches the template as a
    variable of that name, and "none" turns thinking off (`enable_thinking: false`, what
    Qwen3's hybrid templates read) unless `chat_template_kwargs` set `enable_thinking`,
    as vLLM renders them."""

    add_generation_prompt: bool | None = None  # default: not when continuing the last one
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, max_length=MAX_CHAT_TEMPLATE_KWARGS
    )
    # Refused unless the server runs with --trust-request-chat-template (server/app.py).
    chat_template: str | None = None
    reasoning_effort: ReasoningEffort | None = None

    _short_enough_chat_template = field_validator("chat_template", mode="before")(
        bounded(lengths=("max_request_chat_template_chars", "chat_template"))
    )

    @property
    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of PromptProcessor.render_chat / process_chat."""
        add_generation_prompt = self.add_generation_prompt
        if add_generation_prompt is None:
            add_generation_prompt = not self.continue_final_message
        return {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": self.template_kwargs,
            "chat_template": self.chat_template,
        }

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The template's extra variables: `chat_template_kwargs` and the effort's."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        variables = {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}
        variables.setdefault("enable_thinking", self.reasoning_effort != "none")
        return variables
