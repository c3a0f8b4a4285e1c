"""The FastAPI application: OpenAI-compatible routes in front of an Orchestrator, plus the capsule routes.

    GET    /v1/models                 the served model, with its bounds (max_model_len, max_tokens)
    GET    /v1/models/{id}            the same model card; 404 for any other id
    POST   /v1/completions            text completions (streamed with stream=true)
    POST   /v1/chat/completions       chat completions, through the model's chat template
    POST   /v1/responses              the Responses API on the same path; a stored response is a capsule
                                      (responses_api.py)
    GET    /v1/capsules               the capsules of the caller's namespace
    DELETE /v1/capsules/{name}        delete one of them
    GET    /metrics                   the capsulert Prometheus metrics (metrics.py)

The generation routes' plain-JSON bodies that validate are served by their endpoints straight from ASGI
(lane.py); everything else through FastAPI. Everything a request needs travels as arguments (its namespace
handle comes from its API key); the application's shared state is one ServerState built at start. Errors
are OpenAI-style JSON (http_errors.py).
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from capsulert.capsule_store import validate_name
from capsulert.errors import CapsuleRTError, DuplicateCapsuleError, QueueFullError, UnknownCapsuleError
from capsulert.chat.prompt import ChatRenderer
from capsulert.serve.generation import RESERVED_PREFIX, Plan, Run
from capsulert.serve.edge import EdgeGuard, EdgeLimits, check_capsule_quota
from capsulert.serve.grammar_budget import build_plan
from capsulert.serve.lane import GenerationLane, GenerationRoute
from capsulert.serve.http_errors import (INVALID, MODEL_NOT_FOUND, ApiError, ErrorKind, describe, error_body,
                                         retry_headers)
from capsulert.serve.metrics import CONTENT_TYPE, CountRequests, ServerMetrics, request_namespace, stream_failed
from capsulert.serve.plans import Limits, chat_logprobs, chat_plan, completion_logprobs, completion_plan, model_card
from capsulert.serve.bodies import ChatCompletionRequest, CompletionRequest
from capsulert.serve.responses import Shape
from capsulert.serve.responses_api import ResponseShape, StoredResponses, response_plan
from capsulert.serve.responses_bodies import ResponsesRequest
from capsulert.serve.streaming import DONE, EventStream, sse
from capsulert.serve.tenants import Tenants
from capsulert.serve.token_text import TokenText

if TYPE_CHECKING:
    from capsulert.orchestrator.namespace import Namespace
    from capsulert.orchestrator.orchestrator import Orchestrator

log = logging.getLogger(__name__)

# FastAPI's OpenTelemetry spans and metrics: off, and not even looked up per request (the server keeps its
# own metrics, metrics.py)
NO_TELEMETRY = {"tracing": False, "metrics": False, "logs": False}


class Admission:
    """Generation requests in flight (running, or queued for sessions in the orchestrator's admission
    queue); one past the limit is refused (429, with Retry-After) instead of queueing unbounded."""

    def __init__(self, limit: int, metrics: ServerMetrics, retry_after: Callable[[], float] = lambda: 1.0):
        self.limit, self.inflight, self._metrics, self._retry_after = limit, 0, metrics, retry_after

    def enter(self) -> None:
        if self.inflight >= self.limit:
            raise QueueFullError(f"{self.inflight} requests are in flight or queued, the server's limit; retry later",
                                 retry_after_s=self._retry_after())
        self.inflight += 1
        self._metrics.inflight(self.inflight)

    def leave(self) -> None:
        self.inflight -= 1
        self._metrics.inflight(self.inflight)


@dataclass(frozen=True)
class ServerState:
    orchestrator: "Orchestrator"
    tenants: Tenants
    limits: Limits
    tokens: TokenText
    chat: ChatRenderer  # the checkpoint's chat template with the tokenizer (capsulert/chat)
    admission: Admission
    metrics: ServerMetrics
    exposition: Callable[[], bytes] | None = None  # the metrics as Prometheus text (GET /metrics); None: no metrics
    responses: StoredResponses = field(default_factory=StoredResponses)  # for previous_response_id
    edge: EdgeLimits = EdgeLimits()  # body size and capsule quotas (edge.py)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="capsulert", docs_url=None, redoc_url=None, openapi_url=None, telemetry=NO_TELEMETRY)
    _install_error_handlers(app)

    def namespace(authorization: str | None) -> "Namespace":
        name = state.tenants.namespace_for(authorization)
        request_namespace(name)
        return state.orchestrator.namespace(name)

    async def tenant(authorization: str | None = Header(None)) -> "Namespace":  # async: no threadpool hop
        return namespace(authorization)

    async def completions(body: CompletionRequest, ns: "Namespace" = Depends(tenant)) -> Response:
        t0 = time.perf_counter()
        plan = await build_plan(completion_plan, body, state.limits, state.tokens)  # a grammar: off the loop
        shape = _shape(state, False, completion_logprobs(body), body.return_token_ids)
        return await _respond(state, "completions", ns, plan, shape, body.stream, body.include_usage, t0)

    async def chat_completions(body: ChatCompletionRequest, ns: "Namespace" = Depends(tenant)) -> Response:
        t0 = time.perf_counter()
        plan = await build_plan(chat_plan, body, state.limits, state.tokens, state.chat)
        shape = _shape(state, True, chat_logprobs(body), body.return_token_ids, plan.parse_tools,
                       body.tool_arguments_incremental)
        return await _respond(state, "chat", ns, plan, shape, body.stream, body.include_usage, t0)

    # plain-JSON bodies that validate take the lane (lane.py); the rest FastAPI's routes, the same endpoints
    generation = {"/v1/completions": GenerationRoute(CompletionRequest, completions),
                  "/v1/chat/completions": GenerationRoute(ChatCompletionRequest, chat_completions)}
    for path, route in generation.items():
        app.post(path)(route.endpoint)
    app.add_middleware(GenerationLane, routes=generation, namespace=namespace, refusal=refusal)
    app.add_middleware(EdgeGuard, tenants=state.tenants, max_body_bytes=state.edge.max_body_bytes)  # key, then size
    app.add_middleware(CountRequests, metrics=state.metrics)  # outside the lane: every request, refusals included

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, ns: "Namespace" = Depends(tenant)) -> Response:
        return await _respond_response(state, ns, body)

    @app.get("/v1/models")
    async def models(ns: "Namespace" = Depends(tenant)) -> dict:
        return {"object": "list", "data": [model_card(state.limits)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, ns: "Namespace" = Depends(tenant)) -> dict:
        if model_id != state.limits.model_name:
            raise ApiError(MODEL_NOT_FOUND, f"model {model_id!r} is not served here; this server serves "
                                            f"{state.limits.model_name!r}", "model")
        return model_card(state.limits)

    @app.get("/v1/capsules")
    async def list_capsules(ns: "Namespace" = Depends(tenant)) -> dict:
        rows = await ns.capsules()
        # size_bytes: the whole state (as in a snapshot_as reply); own_bytes: what it holds alone, without the
        # prefix blocks it shares with other capsules
        return {"object": "list", "data": [{"id": c["name"], "object": "capsule", "tokens": c["boundary"],
                                            "tier": c["tier"], "pinned": c["pinned"], "size_bytes": c["size_bytes"],
                                            "own_bytes": c["nbytes"]}
                                           for c in rows if not c["name"].startswith(RESERVED_PREFIX)]}

    @app.delete("/v1/capsules/{name}")
    async def delete_capsule(name: str, ns: "Namespace" = Depends(tenant)) -> dict:
        validate_name(name)
        if name.startswith(RESERVED_PREFIX):
            raise UnknownCapsuleError(f"no capsule {name!r} in this namespace")
        await ns.delete(name)
        return {"id": name, "object": "capsule", "deleted": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.exposition is None:
            raise ApiError(ErrorKind(404, "not_found_error", "no_metrics"), "this server exports no metrics")
        return Response(state.exposition(), media_type=CONTENT_TYPE)

    return app


def _shape(state: ServerState, chat: bool, logprobs: int | None, token_ids: bool, tools: bool = False,
           tool_deltas: bool = False) -> Shape:
    prefix = "chatcmpl-" if chat else "cmpl-"
    return Shape(chat, prefix + uuid.uuid4().hex, int(time.time()), state.limits.model_name, state.tokens,
                 logprobs, token_ids, tools, tool_deltas)


async def _check_new_name(ns: "Namespace", name: str, limits: EdgeLimits) -> None:
    """Refuse a snapshot_as that exists, or that the tenant's capsule quotas leave no room for, before
    generating, not after (the generated text would be lost)."""
    rows = await ns.capsules()
    check_capsule_quota(rows, limits, lambda n: not n.startswith(RESERVED_PREFIX))
    if any(c["name"] == name for c in rows):
        raise DuplicateCapsuleError(f"capsule {name!r} already exists in this namespace; capsules are immutable: "
                                    "delete it first or choose another name")


async def _respond(state: ServerState, route: str, ns: "Namespace", plan: Plan, shape: Shape | ResponseShape,
                   stream: bool, include_usage: bool, t0: float) -> Response:
    if stream:
        events = _events(state, route, ns, plan, shape, include_usage, t0)
        # run the stream up to its first byte here (every choice's first token): a refusal until then (no
        # such capsule, a prompt past max_seq, a full server) is still an HTTP status; and a started
        # generator is always finalized (its sessions closed) even if the response never iterates it
        await events.__anext__()
        return EventStream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    entered = False
    try:
        if plan.snapshot_as is not None:
            await _check_new_name(ns, plan.snapshot_as, state.edge)
        state.admission.enter()
        entered = True
        # every session the request will hold is reserved first (a queue, not a refusal; orchestrator/admission.py)
        async with ns.admitted(plan.sessions, together=plan.n), Run(ns, plan, state.metrics) as run:
            await run.start()
            choices, usage = await run.generate()
            capsule = await run.keep()
    finally:
        if entered:
            state.admission.leave()
    state.metrics.tokens(route, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
    return JSONResponse(shape.body(choices, usage, capsule))


async def _events(state: ServerState, route: str, ns: "Namespace", plan: Plan, shape: Shape | ResponseShape,
                  include_usage: bool, t0: float) -> AsyncIterator[bytes]:
    """A streamed response. Its first item is b"" once the sessions are ready (the route takes it)."""
    run = Run(ns, plan, state.metrics)
    finals, entered, started = [], False, False
    sent: dict[int, int] = {}  # choice index -> characters sent
    try:
        if plan.snapshot_as is not None:
            await _check_new_name(ns, plan.snapshot_as, state.edge)
        state.admission.enter()
        entered = True
        async with ns.admitted(plan.sessions, together=plan.n), run:  # queued for sessions before the status line
            await run.start()
            await run.begin_stream()  # up to every choice's first token: a refusal is still a status
            started = True
            yield b""
            async for chunk in run.stream():
                yield shape.chunk_event(chunk, chunk.index not in sent, sent.get(chunk.index, 0))
                sent[chunk.index] = sent.get(chunk.index, 0) + len(chunk.text)
                if chunk.final is not None:
                    finals.append(chunk.final)
            capsule = await run.keep()
        if include_usage or capsule is not None:
            yield sse(shape.tail_chunk(run.usage(finals) if include_usage else None, capsule))
        yield DONE
    except Exception as e:
        kind, body = describe(e)
        if not started:
            raise  # before the first byte: the route answers with the status
        stream_failed(kind.status)  # counted with the error's status, not the 200 already sent
        if kind.status >= 500 and not isinstance(e, CapsuleRTError):
            log.exception("streamed %s request failed", route)
        yield sse(body)  # the status line is sent: the error travels as an event (the openai client raises it)
    finally:
        if entered:
            state.admission.leave()
        if run.first_token_at is not None:
            state.metrics.ttft(route, run.first_token_at - t0)
        usage = run.usage(finals)
        state.metrics.tokens(route, usage.prompt_tokens, sum(len(c.tokens) for c in finals), usage.cached_tokens)


async def _respond_response(state: ServerState, ns: "Namespace", body: ResponsesRequest) -> Response:
    """POST /v1/responses: planned by responses_api.py, run and answered by _respond as chat completions are.
    A previous response whose capsule is gone (evicted) is served by prefilling its conversation whole."""
    t0 = time.perf_counter()
    for gone in state.responses.forgotten():
        await _drop_quietly(state.orchestrator.namespace(gone.namespace), gone.capsule)
    previous = None
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id, ns.ns)
    response_id = "resp_" + uuid.uuid4().hex
    for use_capsule in (True, False):
        planned = response_plan(body, state.limits, state.tokens, state.chat, previous, response_id, use_capsule)
        shape = ResponseShape(response_id, body, planned, state.responses, ns.ns)
        try:
            return await _respond(state, "responses", ns, planned.plan, shape, body.stream, True, t0)
        except UnknownCapsuleError:
            if planned.plan.capsule is None:
                raise
    raise AssertionError("unreachable: the second plan restores no capsule")


async def _drop_quietly(ns: "Namespace", name: str) -> None:
    try:
        await ns.delete(name)
    except CapsuleRTError as e:  # evicted already, or its worker gone: nothing holds it
        log.debug("could not delete capsule %s: %s", name, e)


# ---------------------------------------------------------------------------------------------- errors
def refusal(method: str, path: str, exc: Exception) -> JSONResponse:
    """The answer to an ApiError or CapsuleRTError (from a route, or the generation lane)."""
    kind, body = describe(exc)
    if kind.status >= 500:
        log.warning("%s %s: %s: %s", method, path, type(exc).__name__, exc)
    return JSONResponse(body, status_code=kind.status, headers=retry_headers(kind, exc))


def _json_error(kind: ErrorKind, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=kind.status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems, param = [], None
        for err in exc.errors():
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or ".".join(loc) or None
            problems.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
        return _json_error(INVALID, error_body(INVALID, "invalid request: " + "; ".join(problems), param))

    @app.exception_handler(ApiError)
    @app.exception_handler(CapsuleRTError)
    async def refused(request: Request, exc: Exception) -> JSONResponse:
        return refusal(request.method, request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = ErrorKind(exc.status_code, "not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return _json_error(kind, error_body(kind, f"{request.method} {request.url.path}: {exc.detail}"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        kind, body = describe(exc)
        return _json_error(kind, body)
