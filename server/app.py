"""The OpenAI-compatible HTTP app: `build_app(settings, engine) -> FastAPI`.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (a chat
completion underneath: server/responses.py), GET /v1/models, GET /v1/models/{model_id},
POST /tokenize, POST /detokenize, GET /openapi.json (API key when configured), GET /health,
GET /version, GET /metrics (open); HEAD too on every GET. No /docs or /redoc.
The app does text work only (templates, tokens, media preprocessing, detokenisation); the
engine, reached through `engine` (server.engine_client.EngineClient), runs the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.errors import EngineDeadError, InvalidRequest
from engine.multimodal.prompt import PromptProcessor
from server.admission import AdmissionController, ServerDraining, SharedCounts
from server.app_state import AppState, load_sampling_defaults, make_fetcher
from server.chat import UUIDS, prepare_chat_prompt
from server.chat_template_fields import ChatTemplateFields
from server.completions import (
    chat_response,
    completion_response,
    naming_prompt,
    prepare_completion_prompts,
)
from server.disconnects import ClientDisconnected, unless_client_leaves
from server.errors import install_error_handlers
from server.field_limits import FieldLimits
from server.jobs import build_job, prompt_bound, tokenised_off_the_loop_if_long
from server.json_body import BoundedJsonRoute
from server.metrics import API_CPU_COUNT_INTERVAL_S, ServerMetrics
from server.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.openai_replies import ModelCard, ModelList, dump
from server.prompt_echo import PromptEcho
from server.request_lifecycle import (
    admit,
    check_alive,
    collect_until_disconnect,
    event_stream,
    finisher,
)
from server.request_limits import RequestLimitMiddleware
from server.request_log import RequestLogMiddleware
from server.response_events import ResponseShaper, stream_response
from server.responses import ResponsesRequest, chat_request
from server.sampling_params import check_structured_output, check_token_ids
from server.settings import ServerSettings
from server.streaming import stream_chat, stream_completion
from server.unicode_check import check_request_text

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


async def _count_api_cpu(metrics: ServerMetrics) -> None:
    while True:
        metrics.count_api_cpu()
        await asyncio.sleep(API_CPU_COUNT_INTERVAL_S)


async def _ensure_started(engine: Any) -> Any:
    ready = getattr(engine, "ready", None)
    if ready is None:
        await engine.start()
        ready = engine.ready
    return ready


def build_app(
    settings: ServerSettings,
    engine: Any,
    *,
    api_server_index: int = 0,
    admission_counts: Any = None,
) -> FastAPI:
    """The FastAPI app serving `engine`; starts the engine in its lifespan if needed.

    `api_server_index` is this process's among `settings.api_server_count` (see
    server/api_servers.py): process 0 exports the engine's stats, and `admission_counts`
    (the launcher's shared array) holds what every process admitted, which the budgets
    bound together (server/admission.py)."""
    model_name = settings.model_name
    metrics = ServerMetrics(model_name, exports_engine_stats=api_server_index == 0)
    count = settings.api_server_count
    shared = None
    if admission_counts is not None:
        shared = SharedCounts(admission_counts, api_server_index)
    admission = AdmissionController(
        max_running=settings.engine.max_num_seqs,
        max_waiting_requests=settings.max_waiting_requests,
        max_waiting_tokens=settings.max_waiting_tokens,
        max_feature_requests=settings.max_feature_requests,
        shared=shared,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ready = await _ensure_started(engine)
        metrics.on_engine_ready(ready)
        processor = await asyncio.to_thread(
            PromptProcessor.from_model_dir, settings.engine.model, settings.chat_template_source()
        )
        sampling_defaults = load_sampling_defaults(settings, announce=api_server_index == 0)
        fetcher = make_fetcher(settings, metrics)
        with contextlib.suppress(AttributeError):
            engine.add_stats_listener(metrics.on_engine_stats)
            engine.add_finish_listener(metrics.on_engine_request_finished)
        UUIDS.capacity = settings.max_remembered_media_uuids  # the process's one registry
        if count > 1:  # a uuid-only part may reach another process than its media did
            engine.share_media_uuids(UUIDS)
        app.state.tessera = AppState(
            settings=settings,
            engine=engine,
            processor=processor,
            fetcher=fetcher,
            metrics=metrics,
            model_name=model_name,
            max_model_len=ready.max_model_len,
            vocab_size=ready.vocab_size,
            kv_capacity_tokens=ready.num_kv_blocks * ready.block_size,
            eos_token_ids=tuple(ready.eos_token_ids),
            sampling_defaults=sampling_defaults,
        )
        cpu_counter = asyncio.create_task(_count_api_cpu(metrics), name="api-cpu")
        try:
            yield
        finally:
            cpu_counter.cancel()
            if fetcher is not None:
                await fetcher.aclose()

    app = FastAPI(
        # A trailing slash is a 404, not a 307 to a URL built from the client's Host header.
        redirect_slashes=False,
        title="Tessera",
        version=VERSION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.admission = admission  # cli.py starts draining it on SIGTERM
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; keeps the log and metrics honest

    app.add_middleware(
        RequestLimitMiddleware,
        max_header_bytes=settings.max_header_bytes,
        max_body_bytes=settings.max_request_body_bytes,
        read_timeout_s=settings.request_read_timeout_s,
        min_body_rate=settings.request_body_min_rate,
    )
    app.state.api_key = settings.api_key  # checked before the body is read (json_body.py)
    app.state.max_json_containers = settings.max_request_json_containers  # server/json_body.py
    app.state.field_limits = FieldLimits.of(settings)  # server/json_body.py
    api = APIRouter(
        dependencies=[Depends(check_request_text)],
        route_class=BoundedJsonRoute,
    )
    # Outermost: logs, ids and counts every request, refusals included.
    app.add_middleware(
        RequestLogMiddleware,
        on_finished=lambda record: metrics.on_http_request(record.route, record.status),
        known_routes=lambda: [*api.routes, *app.routes],
    )
    _add_api_routes(api)
    app.include_router(api)
    _add_open_routes(app)
    return app


def get_and_head(router: FastAPI | APIRouter, path: str, **options: Any):
    """Registers an endpoint for GET (in the schema when `options` say so) and HEAD (never
    in it): RFC 9110 asks HEAD of every GET, and some load balancers and `curl -I` probe
    with it; uvicorn sends the GET's headers without the body. One route for both methods
    gave the two operations one operationId in /openapi.json (fuzz85)."""

    def register(endpoint):
        router.add_api_route(path, endpoint, methods=["GET"], **options)
        router.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
        return endpoint

    return register


def _state(request: Request) -> AppState:
    return request.app.state.tessera


def _add_open_routes(app: FastAPI) -> None:
    @get_and_head(app, "/health")
    async def health(request: Request) -> Response:
        # The 503s are the requests' (server/errors.py: Retry-After, Connection: close).
        state = getattr(request.app.state, "tessera", None)
        if state is None or not getattr(state.engine, "is_alive", False):
            raise EngineDeadError("the engine is not running")
        if request.app.state.admission.is_draining:
            raise ServerDraining("the server is shutting down")
        return JSONResponse({"status": "ok"})

    @get_and_head(app, "/version")
    async def version() -> dict:
        return {"version": VERSION}

    @get_and_head(app, "/metrics")
    async def metrics_route(request: Request) -> Response:
        state = _state(request)
        content, content_type = state.metrics.render()
        return Response(content=content, media_type=content_type)


def _add_api_routes(api: APIRouter) -> None:
    # Our route, not FastAPI's (openapi_url=None), so that it sits behind the API key too.
    @get_and_head(api, "/openapi.json", include_in_schema=False)
    async def openapi_document(request: Request) -> JSONResponse:
        return JSONResponse(request.app.openapi())

    @get_and_head(api, "/v1/models")
    async def list_models(request: Request) -> dict:
        state = _state(request)
        card = ModelCard(id=state.model_name, max_model_len=state.max_model_len)
        return dump(ModelList(data=[card]))

    # A served name may hold "/" (Qwen/Qwen2-VL-...).
    @get_and_head(api, "/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> dict:
        state = _state(request)
        state.check_model(model_id)
        return dump(ModelCard(id=state.model_name, max_model_len=state.max_model_len))

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state = _state(request)
        state.check_model(body.model)
        check_alive(state, request)
        prompt = await _chat_prompt(state, body, request)
        job = build_job(state, body, prompt, prefix="chatcmpl-")
        ticket = admit(request, state, job)
        with_logprobs = body.logprobs
        if body.stream:
            stream = stream_chat(
                job,
                state.engine,
                state.processor.tokenizer,
                with_logprobs=with_logprobs,
                on_finished=finisher(state, request),
            )
            return event_stream(stream, ticket)
        try:
            [(totals, results)] = await collect_until_disconnect(request, state, job)
        finally:
            ticket.release()
        response = chat_response(job, results, totals, state.processor, with_logprobs=with_logprobs)
        return JSONResponse(dump(response, exclude={"system_fingerprint"}))

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state = _state(request)
        state.check_model(body.model)
        check_alive(state, request)
        await check_structured_output(body)
        prepare = functools.partial(prepare_completion_prompts, body, state.processor,
                                    state.vocab_size, prompt_bound(state, body))  # fmt: skip
        prompts = await tokenised_off_the_loop_if_long(prepare, body.prompt)
        jobs = []
        for part, prompt in enumerate(prompts):
            with naming_prompt(part, len(prompts)):
                jobs.append(build_job(state, body, prompt, prefix="cmpl-"))
        request_id = jobs[0].request_id
        if len(jobs) > 1:  # a batch: one answer id, the engine's ids apart
            jobs = [dataclasses.replace(job, request_id=f"{request_id}-{part}",
                                        created=jobs[0].created)
                    for part, job in enumerate(jobs)]  # fmt: skip
        ticket = admit(request, state, *jobs)
        echoes = [
            PromptEcho.of(body, part, job.prompt.token_ids, state.processor,
                          truncated=len(job.prompt.token_ids) < len(prompt.token_ids))
            for part, (job, prompt) in enumerate(zip(jobs, prompts, strict=True))
        ]  # fmt: skip
        if body.stream:
            stream = stream_completion(
                jobs,
                state.engine,
                state.processor.tokenizer,
                echoes=echoes,
                on_finished=finisher(state, request),
                request_id=request_id,
            )
            return event_stream(stream, ticket)
        try:
            outcomes = await collect_until_disconnect(request, state, *jobs)
        finally:
            ticket.release()
        response = completion_response(request_id, jobs, outcomes, state.processor, echoes)
        return JSONResponse(dump(response))

    @api.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        state = _state(request)
        state.check_model(body.model)
        check_alive(state, request)
        translation = chat_request(body)
        with translation.responses_params():
            prompt = await _chat_prompt(state, translation.chat, request)
            job = build_job(state, translation.chat, prompt, prefix="resp_")  # as OpenAI
        if not body.stream or body.wants_logprobs:  # fed token by token (response_events)
            job = dataclasses.replace(job, text_offsets=True)
        ticket = admit(request, state, job)
        shaper = ResponseShaper(job, body, state.processor.tokenizer, logprobs=body.wants_logprobs)
        if body.stream:
            stream = stream_response(
                job,
                state.engine,
                state.processor.tokenizer,
                shaper,
                on_finished=finisher(state, request),
                renamed=translation.renamed,
            )
            return event_stream(stream, ticket)
        try:
            with translation.responses_params():
                [(totals, results)] = await collect_until_disconnect(request, state, job)
        finally:
            ticket.release()
        return JSONResponse(shaper.final(results[0], totals))

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        state = _state(request)
        state.check_model(body.model)
        _check_chat_template_trusted(state, body)
        if body.messages is not None:
            tokens = await unless_client_leaves(request, _chat_tokens(state, body))
            return _tokenized(state, body, tokens)
        if body.prompt is None:
            raise InvalidRequest("give either 'prompt' or 'messages'", param="prompt")
        text = body.prompt
        # A raw prompt gets the tokenizer's BOS as /v1/completions does, unless asked not to.
        processor = state.processor
        encode = processor.encode_prompt if body.with_special_tokens else processor.encode
        # No bound here: counting a text longer than the context is what /tokenize is for.
        tokens = await tokenised_off_the_loop_if_long(functools.partial(encode, text), text)
        return _tokenized(state, body, tokens)

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        state = _state(request)
        state.check_model(body.model)
        check_token_ids(body.tokens, state.vocab_size, "tokens")
        return {"prompt": state.processor.decode(body.tokens, skip_special_tokens=False)}


def _tokenized(state: AppState, body: TokenizeRequest, tokens: list[int]) -> dict:
    answer = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        tokenizer = state.processor.tokenizer
        answer["token_strs"] = [tokenizer.id_to_token(token_id) for token_id in tokens]
    return answer


async def _chat_tokens(state: AppState, body: TokenizeRequest) -> list[int]:
    """The tokens a chat feeds the model, prepared as /v1/chat/completions prepares them:
    rendered and tokenized off the event loop (a slow request template held /health for
    12 s, fuzz79), with the same checks, and each image's or video's placeholders expanded
    to its size, its media fetched and preprocessed (vLLM's /tokenize does the same; one
    placeholder an item counted 32 tokens for a 35-token chat). No bound on the length:
    counting is what /tokenize is for."""
    # every rendering field (ChatTemplateFields': a new one renders here too), and the rest
    # of what the chat's prompt is made of
    include = {*ChatTemplateFields.model_fields, "messages", "tools", "mm_processor_kwargs",
               "cache_salt"}  # fmt: skip
    fields = body.model_dump(exclude_none=True, include=include)
    chat = ChatCompletionRequest.model_validate({**fields, "model": state.model_name})
    prepared = await prepare_chat_prompt(
        chat,
        state.processor,
        state.fetcher,
        max_images=state.settings.max_images_per_request,
        settings=state.settings,
        max_model_len=state.max_model_len,
        remember_uuids=False,
    )
    if not body.with_special_tokens:
        return prepared.token_ids
    before, after = _special_tokens_around(state.processor)
    return [*before, *prepared.token_ids, *after]


def _special_tokens_around(processor: PromptProcessor, probe: str = "a") -> tuple[list, list]:
    """The ids the tokenizer's post-processor puts before and after a text's own (a Llama
    BOS; none for Qwen's), read off a probe encoded with and without them: how vLLM's
    `add_special_tokens: true` on a chat adds them around what the template wrote."""
    plain, special = processor.encode(probe), processor.encode_prompt(probe)
    for start in range(len(special) - len(plain) + 1):
        if special[start : start + len(plain)] == plain:
            return special[:start], special[start + len(plain) :]
    raise AssertionError(f"the tokenizer rewrites {probe!r} when it adds special tokens")


def _check_chat_template_trusted(state: AppState, body: ChatTemplateFields) -> None:
    """A request's own template runs code-like Jinja on the server: only when trusted."""
    if body.chat_template is not None and not state.settings.trust_request_chat_template:
        raise InvalidRequest(
            "request chat templates are disabled on this server (--trust-request-chat-template)",
            param="chat_template",
        )


async def _chat_prompt(state: AppState, body: ChatCompletionRequest, request: Request) -> Any:
    """A chat request's prompt: its grammar checked, its media fetched and preprocessed,
    its messages rendered and tokenised. A client that leaves meanwhile takes its fetches
    and queued decodes with it (they held the shared connections and decode threads)."""
    await check_structured_output(body)
    _check_chat_template_trusted(state, body)
    prepared = prepare_chat_prompt(
        body,
        state.processor,
        state.fetcher,
        max_images=state.settings.max_images_per_request,
        settings=state.settings,
        max_prompt_tokens=prompt_bound(state, body),
        max_model_len=state.max_model_len,
    )
    admission = request.app.state.admission
    admission.num_preparing += 1
    try:
        return await unless_client_leaves(request, prepared)
    finally:
        admission.num_preparing -= 1
