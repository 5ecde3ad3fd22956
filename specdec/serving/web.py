"""HTTP plumbing of the server: OpenAI-style errors, the body-size cap, the API-key check, and an SSE response that
notices a client going away (so its row is freed at the next round).

Errors never carry a stack trace, a request's own input values, or the key: a validation error names the field
(one of the request schemas' names, never a key the client made up) and the rule it broke; anything unexpected is a
plain 500 "internal error".
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
from http import HTTPMethod

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import escaped
from specdec.serving.schemas import REQUEST_MODELS, ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)
FIELD_NAMES = frozenset(name for model in REQUEST_MODELS for name in model.model_fields)  # what a message may name
MAX_RULE_CHARS = 200  # of one broken rule's text
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error answered with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_bytes(status: int, message: str, code: str | None = None) -> bytes:
    return error_response(status, message, code).body


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The 400's message and param: each failing field (up to three) by the names of the request schemas' fields,
    with the rule it broke; never the value sent, nor a key the client made up (a location part that is no field name
    is left out), and each rule's text cut short and escaped (errors.escaped)."""
    messages = {}
    for error in exc.errors():
        loc = [part for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid" or (not loc and error.get("type") != "missing"):
            return "the request body is not a valid JSON object", None
        field = ".".join(part for part in loc if isinstance(part, str) and part in FIELD_NAMES) or "body"
        rule = escaped(str(error.get("msg", "invalid")), MAX_RULE_CHARS)
        messages.setdefault(field, f"{field}: {rule}")
    fields = list(messages)[:3]
    return "; ".join(messages[f] for f in fields) or "invalid request", (fields[0] if fields else None)


def _count(request: Request, status: int) -> None:
    """Requests refused before reaching the engine, in specdec_requests_total."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None and request.method == HTTPMethod.POST and status < 499:
        metrics.requests.labels("rejected" if status == 429 else "invalid").inc()


def install_error_handlers(app) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        _count(request, exc.status)
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        _count(request, 400)
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_value", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = "not found" if exc.status_code == 404 else str(exc.detail)
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.error("unhandled error on %s: %s", request.url.path, type(exc).__name__)
        return error_response(500, "internal error", "internal_error")


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before the app parses it."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._refuse(send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._refuse(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later calls: wait for the client to go away
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        content = error_bytes(413, f"the request body exceeds {self.limit} bytes", "body_too_large")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def host_name(header: bytes) -> str:
    """The host of a Host header, without its port: b"localhost:8000" -> "localhost", b"[::1]:80" -> "[::1]"."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[: text.find("]") + 1] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class HostCheck:
    """ASGI middleware of a server bound to loopback: a request whose Host header names anything but localhost,
    127.0.0.1 or [::1] (any port) is answered 400. A web page's script that reaches 127.0.0.1 through a DNS name it
    rebound sends that name as its Host, so it gets nothing (DNS rebinding)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope.get("headers") or []).get(b"host")
            if host is not None and host_name(host) not in LOOPBACK_NAMES:
                content = error_bytes(400, "the Host header names a host this server does not serve (it answers only "
                                      "localhost, 127.0.0.1 and [::1])", "invalid_host")
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(content)).encode())]})
                await send({"type": "http.response.body", "body": content})
                return None
        return await self.app(scope, receive, send)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def check_api_key(request: Request, key: str | None) -> None:
    """Raise 401 unless the request carries `Authorization: Bearer <key>` (compared in constant time)."""
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if not hmac.compare_digest(_digest(given.strip() if scheme.lower() == "bearer" else ""), _digest(key)):
        raise ApiError(401, "incorrect or missing API key (send it as 'Authorization: Bearer <key>')",
                       "invalid_api_key")


def sse(payload) -> str:
    """One server-sent event of a pydantic model or a dict."""
    data = payload.model_dump_json(exclude_none=False) if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


class EventStream(StreamingResponse):
    """text/event-stream that also listens for the client going away, whatever the ASGI version, and runs
    `on_close` however the stream ends (finished, failed or cut off)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        import anyio

        try:
            async with anyio.create_task_group() as group:
                async def stream():
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        except OSError:
            pass  # the client closed the connection while we wrote
        finally:
            self.on_close()
