"""`/v1/completions`: prompt (string or token ids) -> PreparedPrompt, and response building.

Only one prompt per request: a list of several prompts is rejected with a 400 (`prompt`).
"""

from __future__ import annotations

from engine.errors import InvalidRequest
from engine.multimodal.prompt import PromptProcessor
from server.generation import GenerationTotals, PreparedPrompt
from server.logprobs import chat_logprobs, prompt_logprobs
from server.openai_models import CompletionRequest
from server.openai_replies import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    ResponseMessage,
    ResponseToolCall,
)
from server.prompt_echo import PromptEcho
from server.sampling_params import check_token_ids
from server.streaming import ChoiceResult, GenerationJob, usage_of


def prepare_completion_prompt(
    request: CompletionRequest,
    processor: PromptProcessor,
    vocab_size: int,
    max_prompt_tokens: int | None = None,
) -> PreparedPrompt:
    """The prompt's token ids; a text that cannot fit in `max_prompt_tokens` is refused
    before it is tokenised."""
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        token_ids = processor.encode_prompt(prompt, max_tokens=max_prompt_tokens)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        token_ids = list(prompt)
        check_token_ids(token_ids, vocab_size, "prompt")
    else:
        raise InvalidRequest("only one prompt per request is supported", param="prompt")
    if not token_ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    for token_id in (processor.image_token_id, processor.video_token_id):
        if token_id is not None and token_id in token_ids:  # the engine would say "messages"
            raise InvalidRequest(
                "the prompt holds a media placeholder token, which only a chat message's "
                "image or video part may place",
                param="prompt",
            )
    return PreparedPrompt(token_ids=token_ids)


def completion_response(
    job: GenerationJob,
    results: list[ChoiceResult],
    totals: GenerationTotals,
    processor: PromptProcessor,
    echo: PromptEcho,
) -> CompletionResponse:
    choices = []
    for i, result in enumerate(results):
        echoed, logprobs, scores = echo.first(processor.tokenizer, job.prompt.token_ids,
                                              totals.prompt_logprobs, result.logprobs,
                                              result.text_offsets)  # fmt: skip
        choices.append(
            CompletionChoice(
                index=i,
                text=echoed + result.text,
                logprobs=logprobs,
                finish_reason=result.finish_reason,
                stop_reason=result.stop_reason,
                prompt_logprobs=scores,
            )
        )
    return CompletionResponse(
        id=job.request_id,
        created=job.created,
        model=job.model_name,
        choices=choices,
        usage=usage_of(totals),
    )


def chat_response(
    job: GenerationJob,
    results: list[ChoiceResult],
    totals: GenerationTotals,
    processor: PromptProcessor,
    *,
    with_logprobs: bool,
) -> ChatCompletionResponse:
    choices = [
        ChatChoice(
            index=i,
            message=message,
            logprobs=chat_logprobs(processor.tokenizer, result.logprobs, as_ids=job.tokens_as_ids)
            if with_logprobs
            else None,
            finish_reason=finish_reason,
            stop_reason=result.stop_reason,
        )
        for i, result in enumerate(results)
        for message, finish_reason in [_message(job, result)]
    ]
    scores = None
    if job.sampling.prompt_logprobs is not None:
        scores = prompt_logprobs(processor.tokenizer, totals.prompt_logprobs or [])
    return ChatCompletionResponse(
        id=job.request_id,
        created=job.created,
        model=job.model_name,
        choices=choices,
        usage=usage_of(totals),
        prompt_logprobs=scores,
    )


def _message(job: GenerationJob, result: ChoiceResult) -> tuple[ResponseMessage, str | None]:
    """The assistant message of one choice and its finish reason: its reasoning apart when
    the job has a reasoning parser; with tools, the tool calls found in the rest of the
    text (content None when there is none besides them)."""
    reasoning, text = None, result.text
    splitter = job.reasoning_splitter()
    if splitter is not None:
        reasoning, text = splitter.split(text)
    tools = job.tools
    if tools is None:
        return ResponseMessage(content=text, reasoning_content=reasoning), result.finish_reason
    content, calls = tools.split(text)
    if not calls:
        message = ResponseMessage(content=content, reasoning_content=reasoning)
        return message, result.finish_reason
    tool_calls = [ResponseToolCall.model_validate(call.as_dict()) for call in calls]
    message = ResponseMessage(content=content or None, reasoning_content=reasoning,
                              tool_calls=tool_calls)  # fmt: skip
    return message, tools.finish_reason(result.finish_reason, calls)
