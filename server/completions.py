"""`/v1/completions`: prompts (strings or token ids) -> PreparedPrompts, and response building.

A request may carry a batch of prompts (`prompt` a list of strings or of token-id lists):
each is a job of its own (`n` choices), and the answer lists every prompt's choices in
order, prompt `i`'s choice `j` at index `i * n + j`, as OpenAI's and vLLM's do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from engine.errors import InvalidRequest
from engine.multimodal.prompt import PromptProcessor
from server.generation import GenerationJob, GenerationTotals, PreparedPrompt
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
from server.streaming import ChoiceResult, usage_of


def prepare_completion_prompts(
    request: CompletionRequest,
    processor: PromptProcessor,
    vocab_size: int,
    max_prompt_tokens: int | None = None,
) -> list[PreparedPrompt]:
    """Each prompt's token ids; a text that cannot fit in `max_prompt_tokens` is refused
    before it is tokenised."""
    prompts = request.prompts
    prepared = []
    for index, prompt in enumerate(prompts):
        with naming_prompt(index, len(prompts)):
            prepared.append(_prepare(prompt, processor, vocab_size, max_prompt_tokens))
    return prepared


@contextlib.contextmanager
def naming_prompt(index: int, num_prompts: int) -> Iterator[None]:
    """A 400 about one prompt of a batch names it: as `param` (`prompt[index]`, not
    `prompt`), or in its message where `param` is another field (`max_tokens`)."""
    try:
        yield
    except InvalidRequest as exc:
        if num_prompts > 1 and exc.param == "prompt":
            exc.param = f"prompt[{index}]"
        elif num_prompts > 1:
            exc.message = f"prompt[{index}]: {exc.message}"
        raise


def _prepare(
    prompt: str | list[int],
    processor: PromptProcessor,
    vocab_size: int,
    max_prompt_tokens: int | None,
) -> PreparedPrompt:
    if isinstance(prompt, str):
        token_ids = processor.encode_prompt(prompt, max_tokens=max_prompt_tokens)
    else:
        token_ids = list(prompt)
        check_token_ids(token_ids, vocab_size, "prompt")
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
    request_id: str,
    jobs: Sequence[GenerationJob],
    outcomes: Sequence[tuple[GenerationTotals, list[ChoiceResult]]],
    processor: PromptProcessor,
    echoes: Sequence[PromptEcho],
) -> CompletionResponse:
    """The answer to one prompt's job, or to a batch's (its choices in prompt order)."""
    choices = []
    for part, (job, (totals, results), echo) in enumerate(zip(jobs, outcomes, echoes, strict=True)):
        for i, result in enumerate(results):
            echoed, logprobs, scores = echo.first(processor.tokenizer, job.prompt.token_ids,
                                                  totals.prompt_logprobs, result.logprobs,
                                                  result.text_offsets)  # fmt: skip
            choices.append(
                CompletionChoice(
                    index=part * job.n + i,
                    text=echoed + result.text,
                    logprobs=logprobs,
                    finish_reason=result.finish_reason,
                    stop_reason=result.stop_reason,
                    prompt_logprobs=scores,
                )
            )
    return CompletionResponse(
        id=request_id,
        created=jobs[0].created,
        model=jobs[0].model_name,
        choices=choices,
        usage=usage_of(*(totals for totals, _ in outcomes)),
    )


def chat_response(
    job: GenerationJob,
    results: list[ChoiceResult],
    totals: GenerationTotals,
    processor: PromptProcessor,
    *,
    with_logprobs: bool,
) -> ChatCompletionResponse:
    for result in results:
        totals.add_reasoning(job.count_reasoning(processor.tokenizer, result.token_ids))
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
    reasoning, content = None, result.text
    splitter = job.reasoning_splitter()
    if splitter is not None:
        reasoning, content = splitter.split(content)
        # none when empty, as a stream sends none (fuzz70), or when the client declined it
        reasoning = reasoning if reasoning and job.include_reasoning else None
    calls = []
    if job.tools is not None:
        content, calls = job.tools.split(content)
    if splitter is not None or calls:
        content = content or None  # only thinking or calls: no answer, as vLLM gives it
    if not calls:
        return ResponseMessage(content=content, reasoning_content=reasoning), result.finish_reason
    tool_calls = [ResponseToolCall.model_validate(call.as_dict()) for call in calls]
    message = ResponseMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls)
    return message, job.tools.finish_reason(result.finish_reason, calls)  # type: ignore[union-attr]
