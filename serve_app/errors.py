"""Every error the HTTP API returns is JSON in OpenAI's shape, with the right status:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

`ApiError` is raised anywhere in a route; `install(app)` turns it, validation errors, unknown routes and
methods, and any unexpected exception into that shape (a trailing slash is an unknown route, not a redirect;
a body that is not sent as JSON is 415). `Guard` is the ASGI middleware in front of the routes:
the API key (every path but /health and /healthz) and the request body size, checked before a byte is parsed.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("scd.router")

_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
         404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 422: "invalid_request_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body(), headers=self.headers)


def overloaded(what: str, retry_after_s: int) -> ApiError:
    return ApiError(503, f"{what} is overloaded; retry after {retry_after_s} s", code="overloaded",
                    headers={"Retry-After": str(retry_after_s)})


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if p != "body")
    if first["type"] == "json_invalid":
        return "the request body is not valid JSON", None
    if first["type"] == "extra_forbidden":
        return f"{where}: unknown field (not supported by this server)", where
    if first["type"] == "missing" and not where:
        return "the request body is missing (send a JSON object)", None
    if not where and first["type"] in ("model_attributes_type", "model_type", "dict_type"):
        return "the request body must be a JSON object", None
    message = first["msg"].removeprefix("Value error, ")
    return (f"{where}: {message}" if where else message), where or None


def _is_json(content_type: str | None) -> bool:
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def install(app: FastAPI) -> None:
    """Exception handlers: every error leaves as OpenAI-shaped JSON."""
    app.router.redirect_slashes = False            # a 307 with an empty body is no answer to a POST

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        ctype = request.headers.get("content-type")
        if tuple(first["loc"]) == ("body",) and first["type"] != "missing" and not _is_json(ctype):
            return ApiError(415, f"Content-Type {ctype or '(none)'} is not supported: send the body as JSON "
                                 "with 'Content-Type: application/json'").response()   # FastAPI gave it raw bytes
        message, param = _validation_message(exc)
        return ApiError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
                   f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return ApiError(500, f"internal error ({type(exc).__name__}); the request was not served",
                        code="internal_error").response()


def key_digest(key: str | None) -> str | None:
    """What the router keeps of the API key: its sha256, compared in constant time."""
    return hashlib.sha256(key.encode()).hexdigest() if key else None


class Guard:
    """ASGI middleware: API key on every path but /health and /healthz, then the body size (Content-Length, or counted
    while reading a chunked body). Starlette builds the middleware itself, so its settings are class-wide:
    the Router sets them once when its replica starts (one router per replica process)."""

    OPEN_PATHS = ("/health", "/healthz")
    key_sha: str | None = None
    max_body: int = 1 << 20

    def __init__(self, app):
        self.app = app

    @classmethod
    def configure(cls, key_sha: str | None, max_body: int) -> None:
        cls.key_sha, cls.max_body = key_sha, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.key_sha and scope["path"] not in self.OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token:
                return await _send(send, ApiError(401, "missing API key: send 'Authorization: Bearer KEY'",
                                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            if not hmac.compare_digest(hashlib.sha256(token.strip().encode()).hexdigest(), self.key_sha):
                return await _send(send, ApiError(401, "incorrect API key", code="invalid_api_key",
                                                  headers={"WWW-Authenticate": "Bearer"}))
        if scope["method"] in ("POST", "PUT", "PATCH"):
            declared = headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
                return await _send(send, _too_large(self.max_body))
            body, more = b"", True
            while more:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                body += msg.get("body", b"")
                more = msg.get("more_body", False)
                if len(body) > self.max_body:
                    return await _send(send, _too_large(self.max_body))
            replayed = False

            async def replay():
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body larger than {limit} bytes (limits.max_body_bytes)", code="request_too_large")


async def _send(send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
