"""Offline generation: `LLM(model_dir).generate(prompts)` (and `.chat(messages)`) over the
same EngineCore loop.

A prompt is a str (raw text, tokenized as is, no chat template), a list[int]
(token ids), or {"messages": [...]} (OpenAI-style chat; content parts
{"type": "text", "text"}, {"type": "image", "image": PIL.Image | bytes} (or vLLM's
{"type": "image_pil", "image_pil": PIL.Image}) and
{"type": "video", "video": bytes (a video file) | list of PIL.Image / [H, W, 3] uint8 frames
(taken as sampled already)}), and optionally "mm_processor_kwargs" (as on the HTTP API:
`fps`, `max_frames`, `min_pixels`, `max_pixels`, engine/multimodal/processing.py), and the
chat rendering keys of the HTTP API: "add_generation_prompt", "continue_final_message" and
"chat_template_kwargs".
`SamplingParams` (engine/llm_params.py, vLLM's) also takes `n` (each result's `outputs`
holds that many choices) and `stop` strings (with `include_stop_str_in_output` and
`skip_special_tokens`); every choice's text comes out as the server's for the same request
(engine/choices.py, engine/detokenizer.py: the same code).
Bad input for one prompt gives that prompt a result with `error` set (or raises
`InvalidRequest` when `raise_on_error=True`); the others still complete. That includes
`SamplingParams` fields of the wrong type, which its constructor does not check (`typed`).
One `generate()` runs at a time (another thread's waits for it); one that does not return
(Ctrl-C) aborts its requests, so the next call starts clean. An `LLM` dropped without
`close()` is closed when it is collected.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import msgspec
import PIL.Image
import torch

from engine import protocol
from engine.choices import fan_out
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.detokenizer import SequenceDetokenizer
from engine.errors import InvalidRequest, TesseraError, error_from_info, error_info
from engine.generation_defaults import SamplingDefaults
from engine.llm_media import inlined, processed_media
from engine.llm_params import SamplingParams
from engine.llm_results import ChoiceText, CompletionOutput, GenerationResult
from engine.multimodal.placement import media_input, place_media
from engine.multimodal.tool_call_history import arguments_as_objects
from engine.protocol import EngineRequest, ErrorInfo, Modality
from engine.request_checks import check_prompt_token_ids
from engine.unicode_text import lone_surrogate_path

Prompt = str | list[int] | dict
# The keys of a {"messages": ...} prompt that say how it is rendered (as on the HTTP API;
# `tools` as vLLM's LLM.chat takes them: rendered into the prompt, the answer not parsed).
CHAT_RENDERING_KEYS = ("add_generation_prompt", "continue_final_message",
                       "chat_template_kwargs", "tools")  # fmt: skip


class BuiltRequest(NamedTuple):
    """A prompt made into the engine's request: its tensors (media pixels), and the text it
    came from (vLLM's `RequestOutput.prompt`: the string given, or a chat's rendering; None
    for token ids)."""

    request: EngineRequest
    tensors: list[torch.Tensor]
    prompt_text: str | None


class LLM:
    """An in-process engine for offline batch generation."""

    def __init__(
        self,
        model: str,
        *,
        generation_config: str = "auto",
        override_generation_config: str | None = None,
        **engine_options: Any,
    ) -> None:
        """`generation_config` / `override_generation_config`: where `generate()` without
        sampling params takes its defaults from, as the server's flags of the same names
        (engine/generation_defaults.py)."""
        from engine.multimodal.image_processor import ImageProcessorConfig
        from engine.multimodal.prompt import PromptProcessor
        from engine.multimodal.video import VideoConfig

        self.sampling_defaults = SamplingDefaults.load(
            generation_config, model, override_generation_config
        )
        self.engine = EngineCore(
            EngineConfig(model=model, **engine_options),
            priority_setting='LLM(..., scheduling_policy="priority")',
        )
        self.prompt_processor = PromptProcessor.from_model_dir(model)
        self.image_config = self.video_config = None  # a text-only model takes no media
        if self.engine.model_config.vision is not None:
            self.image_config = ImageProcessorConfig.from_model_dir(model)
            self.video_config = VideoConfig.from_model_dir(model)
        self._ids = itertools.count()
        self._one_call = threading.Lock()
        # Dropped without close(), the engine's helpers stop anyway: a tensor-parallel
        # group's zmq context collected with its sockets open hangs the collector.
        self._closer = weakref.finalize(self, self.engine.close)
        self.last_stats: list = []  # EngineStats of the last generate() call, one per step

    def close(self) -> None:
        """Stops the engine's helpers (feature fetcher, tensor-parallel workers)."""
        self._closer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def processing(self):
        """The media settings of a prompt without `mm_processor_kwargs` (a MediaProcessing
        of `image_config` and `video_config`, which may be replaced)."""
        from engine.multimodal.processing import MediaProcessing

        return MediaProcessing(self.image_config, self.video_config)

    def default_sampling_params(self) -> SamplingParams:
        """What `generate()` uses without sampling params (vLLM's
        `get_default_sampling_params`): the model's recommendations from its
        generation_config.json over SamplingParams' defaults; max_new_tokens, if the file
        sets it, as max_tokens."""
        defaults = self.sampling_defaults
        return SamplingParams(
            max_tokens=defaults.max_tokens or SamplingParams().max_tokens,
            temperature=defaults.temperature,
            top_p=defaults.top_p,
            top_k=defaults.top_k,
            min_p=defaults.min_p,
            repetition_penalty=defaults.repetition_penalty,
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        raise_on_error: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[GenerationResult]:
        """Runs all prompts to completion together; results in prompt order. `priority`:
        one per prompt, lower first (needs `scheduling_policy="priority"`)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if isinstance(sampling_params, dict):  # its keys would be taken for one per prompt
            raise TypeError("sampling_params is a SamplingParams, or a list of one per prompt")
        params = self.default_sampling_params() if sampling_params is None else sampling_params
        one_for_all = isinstance(params, protocol.SamplingParams)
        params_list = [params] * len(prompts) if one_for_all else params
        if len(params_list) != len(prompts):
            raise ValueError("pass one SamplingParams or one per prompt")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError("pass one priority per prompt")
        if not self._closer.alive:
            raise RuntimeError("this LLM is closed")
        request_ids: list[str] = []
        # The engine loop is this call's alone (vLLM's LLM has no lock).
        with self._one_call, _ctrl_c_between_steps(self.engine.config) as interrupted:
            try:
                return self._run(
                    prompts, params_list, priorities, raise_on_error, request_ids, interrupted
                )
            except BaseException:
                # Ctrl-C, or an error escaping mid-call: none of this call's requests may
                # stay in the engine, half stepped, to fail the next call's.
                self.engine.abort_requests(request_ids)
                self.engine.settle()
                raise

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        raise_on_error: bool = False,
        **rendering: Any,
    ) -> list[GenerationResult]:
        """`generate()` of one conversation (a list of message dicts) or of several (a list
        of such lists), as vLLM's `LLM.chat`. `rendering`: "mm_processor_kwargs" and the
        `CHAT_RENDERING_KEYS`, the same for every conversation."""
        unknown = set(rendering) - {*CHAT_RENDERING_KEYS, "mm_processor_kwargs"}
        if unknown:
            raise TypeError(f"LLM.chat() got unknown keyword arguments: {sorted(unknown)}")
        one = not messages or isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        prompts = [{"messages": list(conversation), **rendering} for conversation in conversations]
        return self.generate(prompts, sampling_params, raise_on_error=raise_on_error)

    def _run(
        self,
        prompts: Sequence[Prompt],
        params_list: Sequence[SamplingParams],
        priorities: Sequence[int],
        raise_on_error: bool,
        request_ids: list[str],
        interrupted: Callable[[], bool] = lambda: False,
    ) -> list[GenerationResult]:
        prompt_ids: dict[str, list[int]] = {}
        prompt_texts: dict[str, str | None] = {}
        choices: dict[str, list[ChoiceText]] = {}  # by prompt
        by_engine_id: dict[str, tuple[ChoiceText, SamplingParams]] = {}  # running choices
        results: dict[str, GenerationResult] = {}
        order: list[str] = []  # the prompts' ids (`request_ids`: their choices' too)
        eos_token_ids = self.engine.model_config.eos_token_ids
        tokenizer_eos = self.prompt_processor.tokenizer_eos_token_id
        for prompt, sampling, rank in zip(prompts, params_list, priorities, strict=True):
            request_id = f"llm-{next(self._ids)}"
            order.append(request_id)
            try:
                sampling = typed(sampling)
                request, tensors, prompt_texts[request_id] = self._build_request(
                    request_id, prompt, sampling
                )
                request = msgspec.structs.replace(request, priority=rank)
                if sampling.max_tokens is None:  # vLLM's: the rest of the context
                    request = self._with_room_left(request)
            except TesseraError as exc:
                if raise_on_error:
                    raise
                results[request_id] = GenerationResult(
                    request_id, [], [], "", "error", None, error_info(exc),
                    outputs=[CompletionOutput(0, "", [], "error", error=error_info(exc))],
                )  # fmt: skip
                continue
            prompt_ids[request_id] = request.prompt_token_ids
            choices[request_id] = []
            for index, engine_request in enumerate(fan_out(request, sampling.n)):
                detokenizer = self._detokenizer(request.prompt_token_ids, sampling)
                choice = ChoiceText(index, detokenizer, bool(sampling.stop_strings))
                choices[request_id].append(choice)
                by_engine_id[engine_request.request_id] = (choice, sampling)
                request_ids.append(engine_request.request_id)
                self.engine.add_request(engine_request, tensors)
        self.last_stats = []
        while by_engine_id and self.engine.has_unfinished_requests():
            if interrupted():
                raise KeyboardInterrupt
            step = self.engine.step_overlapped()
            self.last_stats.append(step.stats)
            for output in step.outputs:
                if output.request_id not in by_engine_id:
                    continue
                choice, sampling = by_engine_id[output.request_id]
                # a stop string ended it
                if choice.add(output, sampling, eos_token_ids, tokenizer_eos):
                    self.engine.abort_requests([output.request_id])
                if choice.done is not None:
                    del by_engine_id[output.request_id]
        # A step launched ahead for requests that have finished, or the aborts of choices
        # a stop string ended: one more step, and nothing of this call's is left.
        if self.engine.has_unfinished_requests():
            self.last_stats.append(self.engine.step().stats)
        if interrupted():  # in the call's last step: still the caller's interrupt
            raise KeyboardInterrupt
        for request_id, prompt_choices in choices.items():
            results[request_id] = GenerationResult.of_choices(
                request_id,
                prompt_ids[request_id],
                [choice.done for choice in prompt_choices],  # type: ignore[misc]
                prompt_choices[0].prompt_logprobs,
                prompt_texts[request_id],
                prompt_choices[0].num_cached_tokens,
            )
        for request_id in order:
            error = results[request_id].error
            if raise_on_error and error is not None:
                raise _as_exception(error)
        return [results[request_id] for request_id in order]

    def _with_room_left(self, request: EngineRequest) -> EngineRequest:
        """`request` with the max_tokens that fill the context after its prompt; a prompt
        that leaves no room is refused, as vLLM's is (fuzz115)."""
        max_len = self.engine.runner.max_model_len
        room = max_len - len(request.prompt_token_ids)
        if room < 1:
            raise InvalidRequest(
                f"the prompt ({len(request.prompt_token_ids)} tokens) leaves no room for "
                f"max_tokens=None in the model's context length of {max_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        sampling = msgspec.structs.replace(request.sampling, max_tokens=room)
        return msgspec.structs.replace(request, sampling=sampling)

    def _detokenizer(
        self, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> SequenceDetokenizer:
        """A choice's SequenceDetokenizer, as the server makes it (server/generation.py)."""
        return SequenceDetokenizer(
            self.prompt_processor.tokenizer,
            prompt_token_ids,
            sampling.stop_strings,
            skip_special_tokens=sampling.skip_special_tokens,
            min_tokens=sampling.min_tokens,
            include_stop=sampling.include_stop_str_in_output,
        )

    def _build_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> BuiltRequest:
        sampling = params.engine_params()
        if isinstance(prompt, dict) and "messages" not in prompt:
            prompt = _vllm_prompt(prompt)
        if (path := lone_surrogate_path(prompt, "prompt")) is not None:  # else the tokenizer's
            raise InvalidRequest(  # TypeError, out of generate() for the whole batch (fuzz88)
                f"{path!r} holds a lone UTF-16 surrogate, which is not valid Unicode", param=path
            )
        if isinstance(prompt, str):
            return BuiltRequest(EngineRequest(
                request_id=request_id,
                prompt_token_ids=self.prompt_processor.encode_prompt(prompt),
                sampling=sampling,
            ), [], prompt)  # fmt: skip
        if isinstance(prompt, list):
            # checked before its detokenizer reads the ids (the engine checks them later)
            check_prompt_token_ids(prompt, self.engine.model_config.vocab_size, types=True)
            token_ids = [int(token_id) for token_id in prompt]  # numpy's ints as Python's
            return BuiltRequest(EngineRequest(
                request_id=request_id, prompt_token_ids=token_ids, sampling=sampling
            ), [], None)  # fmt: skip
        if isinstance(prompt, dict) and "messages" in prompt:
            processing = None  # a text-only model: a media part is refused below
            if self.image_config is not None:
                processing = self.processing.narrowed(prompt.get("mm_processor_kwargs"))
            rendering = {key: prompt[key] for key in CHAT_RENDERING_KEYS if key in prompt}
            return self._chat_request(
                request_id, prompt["messages"], sampling, processing, rendering
            )
        raise InvalidRequest(
            "a prompt is a str, a list of token ids, {'prompt': str}, {'prompt_token_ids': "
            "[...]} or {'messages': [...]}",
            param="prompts",
        )

    def _chat_request(
        self,
        request_id: str,
        messages: list[dict],
        sampling: protocol.SamplingParams,
        processing,
        rendering: dict[str, Any] | None = None,
    ) -> BuiltRequest:
        from engine.multimodal.messages import IMAGE_PART_TYPES, VIDEO_PART_TYPES

        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequest("'messages' is a list of message dicts", param="messages")
        items = []  # (modality, ProcessedImage) of every image and video, in prompt order
        for message_index, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for part_index, part in enumerate(content):
                param = f"messages[{message_index}].content[{part_index}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image_url", "video_url"):  # OpenAI's form, for a data: URL
                    part = inlined(part, kind, param)
                    kind = part["type"]
                elif kind == "image_pil":  # vLLM's LLM.chat part
                    if not isinstance(part.get("image_pil"), PIL.Image.Image):
                        raise InvalidRequest("an image_pil part's 'image_pil' is a PIL image",
                                             param=param)  # fmt: skip
                    part, kind = {"type": "image", "image": part["image_pil"]}, "image"
                if kind in ("image", "video"):
                    items.append((kind, processed_media(part, param, processing)))
                elif kind in IMAGE_PART_TYPES | VIDEO_PART_TYPES:  # the HTTP API's other forms
                    raise InvalidRequest(
                        f"a {kind!r} part is the HTTP API's; LLM.generate takes "
                        "{'type': 'image', 'image': a PIL image or encoded bytes}, "
                        "{'type': 'video', 'video': a file's bytes or frames} and "
                        "image_url / video_url parts with data: URLs",
                        param=param,
                    )
        rendering = dict(rendering or {})
        if rendering.get("continue_final_message"):
            rendering.setdefault("add_generation_prompt", False)
        tools = rendering.get("tools") or []
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            raise InvalidRequest("tools is a list of tool dicts", param="tools")
        if "chat_template_kwargs" in rendering:
            rendering["template_kwargs"] = rendering.pop("chat_template_kwargs")
            if not isinstance(rendering["template_kwargs"], dict):
                raise InvalidRequest("chat_template_kwargs is a dict", param="chat_template_kwargs")
        processed = self.prompt_processor.process_chat(
            arguments_as_objects(messages),  # as the server's chat renders them
            media_token_counts=[
                (kind, item.num_tokens, item.frame_seconds) for kind, item in items
            ],  # fmt: skip
            **rendering,
        )
        unplaced = [
            media_input(Modality(kind), item, index) for index, (kind, item) in enumerate(items)
        ]
        media, tensors = place_media(
            unplaced, processed.spans, [item.pixel_levels for _, item in items]
        )
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=processed.token_ids,
            sampling=sampling,
            media=media,
        )
        return BuiltRequest(request, tensors, processed.text)


def _as_exception(error: ErrorInfo) -> TesseraError:
    """A result's error as what `raise_on_error` raises: InvalidRequest for a 400, else a
    TesseraError of the error's own status and type (fuzz124: a server-side 500 was raised
    as an InvalidRequest)."""
    if error.status == InvalidRequest.status:
        return InvalidRequest(error.message, param=error.param, code=error.code)
    return error_from_info(error)


def _vllm_prompt(prompt: dict) -> Any:
    """vLLM's text and token prompt dicts, `{"prompt": str}` and `{"prompt_token_ids":
    [...]}`, as the string or ids they hold (fuzz111: a script written for vLLM failed on
    them). Media go in chat prompts here: `multi_modal_data` would need the model's own
    placeholder tokens written into the text, which chat templates write."""
    if "multi_modal_data" in prompt:
        raise InvalidRequest(
            "multi_modal_data is not supported: pass images and videos as parts of "
            "{'messages': [...]} (LLM.chat), which write their placeholders",
            param="multi_modal_data",
        )
    for key in ("prompt", "prompt_token_ids"):
        if set(prompt) == {key}:
            return prompt[key]
    return prompt  # refused by the caller, naming the forms it takes


@contextlib.contextmanager
def _ctrl_c_between_steps(config: EngineConfig) -> Iterator[Callable[[], bool]]:
    """With tensor-parallel ranks, a Ctrl-C (SIGINT) during a call takes effect between
    steps: one inside a forward left the workers in its collectives, and the LLM broken
    (engine/tensor_parallel.py `whole_forward`). A second Ctrl-C interrupts at once.
    Yields whether one came. Only the main thread can take signals; elsewhere, and with
    a handler of the caller's own, nothing changes."""
    came: list[bool] = []
    is_main = threading.current_thread() is threading.main_thread()
    if (config.tensor_parallel_size == 1 or not is_main
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):  # fmt: skip
        yield lambda: False
        return

    def note(signum: int, frame: Any) -> None:
        if came:
            raise KeyboardInterrupt
        came.append(True)

    signal.signal(signal.SIGINT, note)
    try:
        yield lambda: bool(came)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def typed(sampling: Any) -> SamplingParams:
    """`sampling` with every field's type checked, which a msgspec Struct's constructor
    does not do (the server's are decoded, and so checked): a wrong type fails its own
    prompt, naming the field, instead of a step for the whole batch."""
    if not isinstance(sampling, protocol.SamplingParams):
        raise InvalidRequest(
            f"sampling params are a SamplingParams, not {type(sampling).__name__}",
            param="sampling_params",
        )
    try:
        params = msgspec.convert(msgspec.to_builtins(sampling, enc_hook=_plain), SamplingParams)
    except TypeError as exc:  # a value that is no plain data at all
        raise InvalidRequest(f"invalid sampling params: {exc}", param="sampling_params") from None
    except msgspec.ValidationError as exc:
        named = re.search(r"at `\$\.(\w+)", str(exc))
        raise InvalidRequest(
            f"invalid sampling params: {exc}", param=named.group(1) if named else "sampling_params"
        ) from None
    return params.check()


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (np.float32(0.7), np.arange(5)) as the Python values they
    hold: they worked before the types were checked, and they still do."""
    for name in ("tolist", "item"):
        if callable(getattr(value, name, None)):
            return getattr(value, name)()
    raise TypeError(f"{type(value).__name__} is not a number, string or sequence")
