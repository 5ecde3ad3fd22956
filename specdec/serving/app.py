"""The OpenAI-compatible ASGI app (fastapi): /v1/completions, /v1/chat/completions (streaming or not),
/v1/models, /health and /metrics, over one Engine. Handlers parse, enqueue and await; they never run the model.

    app = build_app(ServeOptions(bundle="bundles/smollm2-q41"))   # uvicorn.run(app, host="127.0.0.1")
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from specdec.errors import CapacityError, ConfigError, ManifestError, SpecDecError
from specdec.runtime.config import GenerationConfig
from specdec.serving.engine import Engine, EngineClosedError, EventKind, QueueFullError
from specdec.serving.metrics import Metrics
from specdec.serving.options import REPLICA_HEADER, ServeOptions
from specdec.serving.prompts import INLINE_CHARS, PromptBudgetError, PromptPool, PromptWorkersBusy
from specdec.serving.schemas import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    Completion, CompletionChoice, CompletionRequest, Delta, ModelCard, ModelList, SpecdecOptions, Usage, new_id, now,
)
from specdec.serving.web import (
    ApiError, BodyLimit, EventStream, HostCheck, check_api_key, install_error_handlers, sse,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left in S


def build_app(options: ServeOptions, engine: Engine | None = None, replica: str | None = None,
              prompts: PromptPool | None = None) -> FastAPI:
    """The app. Without `engine` it loads the bundle at startup and closes it at shutdown (the lifespan);
    with one, the caller starts and closes it. Without `prompts` it starts the prompt workers at startup; with an
    open pool (`specdec serve` opens it before the server starts, where a SIGTERM can end the wait) it uses that one.
    Either way the lifespan's end kills the workers. `replica` is sent back in an `x-specdec-replica` header."""
    metrics = engine.metrics if engine is not None else Metrics()
    owned = engine is None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if owned:
            app.state.engine = await asyncio.to_thread(lambda: Engine.from_options(options, metrics).start())
        try:
            if app.state.prompts is None:
                app.state.prompts = await PromptPool(app.state.engine.requests.root, options.prompt_budget).start()
            yield
        finally:
            if app.state.prompts is not None:
                app.state.prompts.close()  # kills workers mid-render: a runaway template never holds up a stop
            if owned and app.state.engine is not None:
                await asyncio.to_thread(app.state.engine.close)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.options, app.state.metrics = engine, options, metrics
    app.state.prompts = prompts
    app.state.model_name = options.model_name or Path(options.bundle).resolve().name
    install_error_handlers(app)
    app.include_router(_api_router(options))
    _add_plain_routes(app, options)
    if replica is not None:
        @app.middleware("http")
        async def _replica_header(request: Request, call_next):
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = replica
            return response
    app.add_middleware(BodyLimit, limit=options.max_body_bytes)
    if options.loopback:
        app.add_middleware(HostCheck)
    return app


def _add_plain_routes(app: FastAPI, options: ServeOptions) -> None:
    def authorized(request: Request) -> None:
        check_api_key(request, options.key)

    @app.get("/health")
    async def health(request: Request):
        engine = request.app.state.engine
        if engine is None or not engine.running:
            raise ApiError(503, "the engine is not running", "engine_not_running")
        prompts = request.app.state.prompts
        if prompts is not None and prompts.saturated:
            state = prompts.state()
            raise ApiError(503, f"the prompt workers are saturated ({state['workers']} running, {state['waiting']} "
                                "requests waiting for one): chat requests wait", "prompt_workers_saturated")
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics(request: Request):
        content, media_type = request.app.state.metrics.exposition()
        return Response(content, media_type=media_type)


def _api_router(options: ServeOptions) -> APIRouter:
    def authorized(request: Request) -> None:
        check_api_key(request, options.key)

    router = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @router.get("/models")
    async def models(request: Request) -> ModelList:
        return ModelList(data=[ModelCard(id=request.app.state.model_name, created=now())])

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        engine = _engine(request, body.model)
        ids = await _prompt_ids(request, engine, body.prompt)
        config = _config(engine, body, len(ids), COMPLETION_DEFAULT_MAX_TOKENS)
        ticket = _submit(engine, ids, config, body.stream)
        rid, created, name = new_id("cmpl"), now(), request.app.state.model_name
        if body.stream:
            return EventStream(_completion_events(ticket, rid, created, name, body.include_usage), ticket.cancel)
        text, done = await _collect(ticket, request)
        choice = CompletionChoice(text=text, finish_reason=done.finish_reason)
        return Completion(id=rid, created=created, model=name, choices=[choice], usage=_usage(done))

    @router.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        engine = _engine(request, body.model)
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        ids = await _chat_ids(request, engine, messages)
        config = _config(engine, body, len(ids), None, body.max_completion_tokens)
        ticket = _submit(engine, ids, config, body.stream)
        rid, created, name = new_id("chatcmpl"), now(), request.app.state.model_name
        if body.stream:
            return EventStream(_chat_events(ticket, rid, created, name, body.include_usage), ticket.cancel)
        text, done = await _collect(ticket, request)
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=done.finish_reason)
        return ChatCompletion(id=rid, created=created, model=name, choices=[choice], usage=_usage(done))

    return router


# --- request -> engine ------------------------------------------------------------------------------------------
def _engine(request: Request, model: str) -> Engine:
    if model != request.app.state.model_name:
        raise ApiError(404, "the requested model does not exist; GET /v1/models lists the one served here",
                       "model_not_found", "model")
    engine = request.app.state.engine
    if engine is None or not engine.running:
        raise ApiError(503, "the engine is not running", "engine_not_running")
    return engine


def _refuse(exc: SpecDecError) -> ApiError:
    """A refused request's 400, in words that never echo what the client sent: the rule it broke (`public`), never
    the library's message, which names the value."""
    default = "context_length_exceeded" if isinstance(exc, CapacityError) else "invalid_value"
    public = getattr(exc, "public", None) or "the request cannot be served with these options"
    hint = f" ({exc.hint})" if exc.hint and hasattr(exc, "public") else ""
    return ApiError(400, f"{public}{hint}", getattr(exc, "code", None) or default, getattr(exc, "option", None))


async def _prompt_ids(request: Request, engine: Engine, prompt) -> list:
    """Token ids of a completion's prompt: a long text prompt is tokenized by a prompt worker, never holding up the
    event loop or (the tokenizer holds the GIL) the engine; anything else on a worker thread."""
    layer, pool = engine.requests, request.app.state.prompts
    with _refusals():
        if isinstance(prompt, str) and len(prompt) > INLINE_CHARS and pool is not None:
            return layer.text_ids(await pool.text_ids(layer.prompt_text(prompt)))
        return await asyncio.to_thread(layer.prompt_ids, prompt)


async def _chat_ids(request: Request, engine: Engine, messages: list) -> list:
    """Token ids of a conversation, rendered by the chat template and tokenized by a prompt worker, on its budget."""
    layer, pool = engine.requests, request.app.state.prompts
    with _refusals():
        if pool is None:  # an app whose lifespan did not run: the generator's own prompt worker, on its budget
            return await asyncio.to_thread(layer.chat_ids, messages)
        layer.check_messages(messages)
        try:
            ids = await pool.chat_ids(messages, layer.max_text_bytes)
        except ConfigError as exc:
            raise layer.render_refusal(exc) from None
        return layer.text_ids(ids)


@contextmanager
def _refusals():
    """A prompt's refusal as the client's 400, the model's chat template or the workers' budget as a 5xx."""
    try:
        yield
    except ManifestError:  # the model's chat template, refused by the sandbox: the server's fault, not the client's
        raise ApiError(500, "this model's chat template cannot be rendered safely", "server_error", None) from None
    except PromptBudgetError as exc:
        raise ApiError(500, f"{exc.message} ({exc.hint})", "prompt_budget_exceeded") from None
    except PromptWorkersBusy as exc:
        raise ApiError(503, f"{exc.message} ({exc.hint})", "prompt_workers_busy", headers={"retry-after": "1"}) from None
    except SpecDecError as exc:
        raise _refuse(exc) from None


def _config(engine: Engine, body, prompt_len: int, default_max: int | None, alt_max: int | None = None):
    """The request's effective GenerationConfig: what the body sets; what it leaves out (null) is left unset, and
    the request layer gives it the bundle's default, as it does offline (a value set, top_k 0 included, is kept)."""
    ext = body.specdec or SpecdecOptions()
    max_tokens = body.max_tokens or alt_max or default_max or engine.requests.room(prompt_len)
    try:
        return engine.requests.config(GenerationConfig(
            max_new_tokens=max_tokens, seed=body.seed, gamma=ext.gamma, drafter=ext.drafter or "auto",
            temperature=body.temperature, top_k=ext.top_k, top_p=body.top_p, stop=tuple(body.stop or ())))
    except SpecDecError as exc:
        raise _refuse(exc) from None


def _submit(engine: Engine, ids: list, config: GenerationConfig, stream: bool):
    try:
        return engine.submit(ids, config, stream)
    except QueueFullError as exc:
        retry = str(engine.options.retry_after_s)
        raise ApiError(429, exc.message, "queue_full", headers={"retry-after": retry}) from None
    except EngineClosedError as exc:
        raise ApiError(503, exc.message, "engine_not_running") from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(ticket, request: Request) -> tuple:
    """-> (text, the final Event) of a non-streaming request; a client that goes away cancels it."""
    async def final():
        parts = []
        async for event in ticket.events():
            if event.kind == EventKind.TEXT:
                parts.append(event.text)
            else:
                return "".join(parts), event

    waiter = asyncio.ensure_future(final())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not waiter.done():
            waiter.cancel()
            ticket.cancel()
    if waiter.cancelled():
        raise ApiError(499, "the client closed the request", "client_closed")
    text, event = waiter.result()
    if event.kind == EventKind.ERROR:
        raise ApiError(event.status, event.text, "generation_failed")
    return text, event


def _usage(done) -> Usage:
    return Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                 total_tokens=done.prompt_tokens + done.completion_tokens)


def _error_event(event) -> str:
    kind = "service_unavailable" if event.status == 503 else "server_error"
    return sse({"error": {"message": event.text, "type": kind, "param": None, "code": "generation_failed"}})


async def _completion_events(ticket, rid: str, created: int, name: str, include_usage: bool):
    def chunk(text: str = "", finish: str | None = None, usage=None, choices=True) -> str:
        choice = [CompletionChoice(text=text, finish_reason=finish)] if choices else []
        return sse(Completion(id=rid, created=created, model=name, choices=choice, usage=usage))

    async for event in ticket.events():
        if event.kind == EventKind.TEXT:
            yield chunk(event.text)
        elif event.kind == EventKind.DONE:
            yield chunk(finish=event.finish_reason)
            if include_usage:
                yield chunk(usage=_usage(event), choices=False)
        else:
            yield _error_event(event)
    yield "data: [DONE]\n\n"


async def _chat_events(ticket, rid: str, created: int, name: str, include_usage: bool):
    def chunk(delta: Delta | None, finish: str | None = None, usage=None) -> str:
        choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=finish)]
        return sse(ChatCompletionChunk(id=rid, created=created, model=name, choices=choices, usage=usage))

    yield chunk(Delta(role="assistant", content=""))
    async for event in ticket.events():
        if event.kind == EventKind.TEXT:
            yield chunk(Delta(content=event.text))
        elif event.kind == EventKind.DONE:
            yield chunk(Delta(), event.finish_reason)
            if include_usage:
                yield chunk(None, usage=_usage(event))
        else:
            yield _error_event(event)
    yield "data: [DONE]\n\n"
