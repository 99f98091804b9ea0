"""The routes: OpenAI's /v1 API, /health, /metrics, /stats and the live page at /.

A generate request is sent to the daemon at once and its first reply awaited before the
HTTP answer starts, so every refusal (busy, too long, unreachable) still gets its own HTTP
status; after that the answer streams. A client that leaves cancels its request in the
daemon (`LinkCall.close`), streaming or not.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.sse import EventSourceResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from frontend.api_key import ApiKey
from frontend.body_limit import BodyLimit
from frontend.drain import NO_DRAIN, Drain
from frontend.errors import (
    APIError,
    cancelled_by_daemon,
    from_daemon,
    from_protocol,
    from_validation,
    misspoke,
    shutting_down,
    too_many_open,
    unreachable,
)
from frontend.hosts import AllowedHosts
from frontend.link import HEARTBEAT_S, ClientGone, DaemonMisspoke, DaemonUnreachable, LinkCall, TargetLink, TooManyOpen
from frontend.metrics import registry_for
from frontend.responses import DONE_EVENT, Answer, sse
from frontend.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, check_model
from frontend.settings import DEFAULTS, FrontendSettings
from protocol import Message, ProtocolError

PAGE = Path(__file__).resolve().parent / "static" / "index.html"
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
GENERATE_PATHS = (CHAT_PATH, COMPLETIONS_PATH)  # the routes that read a body
CLIENT_CLOSED = 499  # nginx's status for a client that went away; nobody reads it


def create_app(link: TargetLink, settings: FrontendSettings = DEFAULTS, drain: Drain | None = None) -> FastAPI:
    """The front end for the target daemon behind `link`, answering as `settings` say; `drain`:
    when the answers still running end as the server shuts down."""
    # No /docs, /redoc or /openapi.json: they answered without the API key, and /docs fetched its
    # script from a CDN (an audit); docs/http.md is the reference.
    app = FastAPI(title="dflash-split", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=settings.max_body_size, paths=GENERATE_PATHS)
    if settings.api_key is not None:  # added last, so it runs first: a stranger's body is never read
        app.add_middleware(ApiKey, key=settings.api_key)
    if settings.allowed_hosts is not None:  # first of all: a request for another host is no one's
        app.add_middleware(AllowedHosts, names=settings.allowed_hosts)
    front = Front(link, settings.model_name, settings.default_max_tokens, drain or NO_DRAIN)
    _error_handlers(app)
    _info_routes(app, front)

    @app.post(CHAT_PATH)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await front.generate(body, request, chat=True)

    @app.post(COMPLETIONS_PATH)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await front.generate(body, request, chat=False)

    return app


class Front:
    """What the routes share: the daemon's link, the served model's name, the default answer length."""

    def __init__(self, link: TargetLink, model_name: str | None, default_max_tokens: int, drain: Drain) -> None:
        self.link, self.model_name, self.default_max_tokens = link, model_name, default_max_tokens
        self.drain = drain
        self.started = int(time.time())

    async def served_name(self) -> str | None:
        return self.model_name or await self.link.model_name()

    def unreachable(self, why: str = "") -> APIError:
        return unreachable(f"the target daemon at {self.link.address} does not answer{why}")

    async def generate(self, body: ChatCompletionRequest | CompletionRequest, request: Request, chat: bool) -> Response:
        name = await self.served_name()
        if name is None:
            raise self.unreachable()
        check_model(body.model, name)
        body.check_supported()
        answer = Answer(chat, name, body.include_usage)
        try:
            call = self.link.generate(body.to_daemon(self.default_max_tokens))
        except ProtocolError as exc:  # beyond what the wire carries (a stop string over 256 chars, ...)
            raise from_protocol(exc.message, body.prompt_param) from exc

        async def gone() -> bool:  # the client left, or the server shuts down
            return self.drain.due() or await request.is_disconnected()

        try:
            first = await call.next(gone=gone)
            check(first, body)
        except ClientGone:
            if self.drain.due():  # the answer first: the cancel waits for the daemon's word
                wait_s = self.drain.cancel_wait_s()
                return shutting_down().response(background=BackgroundTask(call.close, wait_s))
            await call.close()
            return Response(status_code=CLIENT_CLOSED)
        except DaemonUnreachable as exc:
            await call.close()
            raise unreachable(str(exc)) from exc
        except BaseException:
            await call.close()
            raise
        if not body.stream:
            await call.close()
            return JSONResponse(answer.complete(first["text"], first["finish_reason"], first["stats"]))
        # The stream closes the call when it ends or is cancelled; the background task covers a
        # client gone before the stream even started (closing twice is harmless).
        return EventSourceResponse(
            events(call, first, answer, body, self.drain),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},  # proxies: pass chunks on at once
            background=BackgroundTask(call.close),
        )


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape, whoever raised it."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(TooManyOpen)
    async def no_room(request: Request, exc: TooManyOpen) -> JSONResponse:
        return too_many_open(str(exc)).response()

    @app.exception_handler(DaemonMisspoke)
    async def daemon_misspoke(request: Request, exc: DaemonMisspoke) -> JSONResponse:
        return misspoke(str(exc)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI's own 400s are bodies its parser gave up on (invalid UTF-8, a number too long to read).
        code = {404: "not_found", 400: "invalid_json"}.get(exc.status_code)
        # Its headers kept: a 405's Allow, which HTTP requires, was dropped (an audit).
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()


def _info_routes(app: FastAPI, front: Front) -> None:
    """The routes that generate nothing: the live page, health, models, metrics, stats."""

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD: probes of the page
    async def page() -> FileResponse:
        return FileResponse(PAGE, media_type="text/html")

    @app.get("/health")
    async def health() -> JSONResponse:
        if not await front.link.alive():
            raise front.unreachable()
        return JSONResponse({"status": "ok"})

    async def card() -> dict:
        name = await front.served_name()
        if name is None:
            raise front.unreachable(", so its model is unknown")
        return {"id": name, "object": "model", "created": front.started, "owned_by": "dflash-split"}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [await card()]})

    # The SDK's models.retrieve(name): a 404 for the very model served, before (an audit).
    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        found = await card()
        check_model(model, found["id"])
        return JSONResponse(found)

    @app.get("/metrics")
    async def metrics() -> Response:
        figures = await front.link.stats()  # shared with /stats and other scrapes waiting now
        registry = registry_for(lambda: figures)
        return Response(await to_thread.run_sync(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> JSONResponse:
        """The daemon's stats reply as JSON: the live page's source."""
        figures = await front.link.stats()
        if figures is None:
            raise front.unreachable()
        # The served name, not the daemon's folder: this route is open where /v1/models is not (an audit).
        return JSONResponse({**figures, "model": await front.served_name()})


def check(reply: Message, body: GenerationRequest) -> None:
    """A daemon `error` reply as the HTTP error it means; an answer the daemon cut off unasked (the
    front end cancels only for a client that left, who reads nothing) as an error, not a `stop`."""
    if reply.type == "error":
        raise from_daemon(reply["code"], reply["message"], body.prompt_param, body.limit_param)
    if reply.type == "done" and reply["finish_reason"] == "cancelled":
        raise cancelled_by_daemon(HEARTBEAT_S)


async def events(
    call: LinkCall, reply: Message, answer: Answer, body: GenerationRequest, drain: Drain = NO_DRAIN
) -> AsyncIterator[bytes]:
    """The SSE stream from the first reply on, ending with `data: [DONE]`.

    Leaving early (the client went away: Starlette cancels this generator) cancels the
    request in the daemon through `call.close`; so does the server's shutdown (`drain`), after
    an error event.
    """
    drained = False
    try:
        if answer.chat:
            yield sse(answer.chunk(first=True))
        while True:
            try:
                check(reply, body)
            except APIError as exc:
                yield sse(exc.body())
                break
            if reply.type == "chunk" and reply["text"]:
                yield sse(answer.chunk(reply["text"]))
            if reply.type == "done":
                yield sse(answer.chunk(None if answer.chat else "", reply["finish_reason"]))
                if answer.include_usage:
                    yield sse(answer.usage_chunk(reply["stats"]))
                break
            if drain.due():
                raise ClientGone("the server shuts down")
            reply = await call.next(gone=drain.cut)
    except ClientGone:  # only the drain's (a client that left is a cancellation): before the cancel
        drained = True
        yield sse(shutting_down().body())
        yield DONE_EVENT
    except DaemonUnreachable as exc:
        yield sse(unreachable(str(exc)).body())
    except DaemonMisspoke as exc:
        yield sse(misspoke(str(exc)).body())
    except TooManyOpen as exc:  # a ping with no socket left: the stream ended with no word (a review)
        yield sse(too_many_open(str(exc)).body())
    finally:
        await call.close(drain.cancel_wait_s() if drained else None)
    if not drained:
        yield DONE_EVENT
