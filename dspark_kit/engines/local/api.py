"""The local engine's OpenAI-compatible request schema, error shape, input checks and guard.

Kept apart from the server (local_server.py) so the rules a request must pass
read as one list: bad input is a 4xx in OpenAI's error shape, never a 500,
and fields we cannot honour are refused rather than silently ignored. The
guard (API key, body size, in-flight limit) runs before any route.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, Strict
from starlette.exceptions import HTTPException as StarletteHTTPException

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")  # fullmatch: `$` would let "x\n" through
MAX_BODY_BYTES = 16 * 2**20
MAX_TEMPERATURE = 100.0  # finite and sane; 1e9 or Infinity is a client bug, not a sampling request
DISCONNECT_POLL_S = 0.1
SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> dict:
    """OpenAI's error shape, used for every error this server answers."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
    return JSONResponse(error_body(status, message, kind, param), status)


ERROR_KINDS = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "RequestTooLargeError", 422: "BadRequestError",
          503: "ServiceUnavailableError"}

INT64 = 2**63
StrictPosInt = Annotated[int, Strict(), Field(ge=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with the usage (choices: [])
    continuous_usage_stats: bool = False  # usage so far on every chunk too (vLLM's extension)


class OpenAIRequest(BaseModel):
    # extra fields are allowed only to be inspected: check_extras refuses what we cannot honour
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: StrictPosInt | None = None
    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: Annotated[int, Strict()] | None = Field(None, ge=-INT64, lt=INT64)  # vLLM: a C long long
    n: Annotated[int, Strict()] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    return_token_ids: bool = False
    request_id: str | None = None
    ignore_eos: Annotated[bool, Strict()] = False  # vLLM's extension: decode max_tokens whatever comes


class ChatRequest(OpenAIRequest):
    max_completion_tokens: StrictPosInt | None = None  # the newer OpenAI name of max_tokens

    messages: list[dict[str, Any]] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None  # served with --enable-auto-tool-choice (local/tools.py)
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(OpenAIRequest):
    prompt: str | list[Annotated[int, Strict()]] = Field(min_length=1)
    max_tokens: StrictPosInt | None = 16


# Fields OpenAI clients may send that this engine cannot honour: accepted only at their no-op
# value, refused (400) otherwise, never silently ignored.
_NOOP_FIELDS: dict[str, Any] = {
    "logprobs": lambda v: v in (None, False), "top_logprobs": lambda v: v in (None, 0),
    "prompt_logprobs": lambda v: v is None, "echo": lambda v: v in (None, False),
    "functions": lambda v: not v, "function_call": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: True if v is None else v in (True, False),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "logit_bias": lambda v: not v, "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0), "repetition_penalty": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1), "suffix": lambda v: not v, "top_k": lambda v: v in (None, 0, -1),
    "min_p": lambda v: v in (None, 0), "min_tokens": lambda v: v in (None, 0),
    "user": lambda v: True, "metadata": lambda v: True, "store": lambda v: v in (None, False),
}


def check_extras(req: OpenAIRequest) -> None:
    for name, value in (req.model_extra or {}).items():
        ok = _NOOP_FIELDS.get(name)
        if ok is None:
            raise ApiError(400, f"{name}: not supported by the local engine (remove the field)", param=name)
        try:
            fine = ok(value)
        except TypeError:
            fine = False
        if not fine:
            raise ApiError(400, f"{name}={value!r}: not supported by the local engine", param=name)


def check_text(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{where}: text is not valid Unicode (lone surrogate)", param=where) from None


def check_messages(messages: list[dict[str, Any]]) -> None:
    """What vLLM refuses and the tokenizer would choke on, as 400s before any work."""
    for i, m in enumerate(messages):
        where = f"messages.{i}.content"
        if m.get("content") is None and m.get("role") == "assistant" and m.get("tool_calls"):
            continue  # a turn that only calls tools (OpenAI sends content null)
        if "content" not in m or m["content"] is None:
            raise ApiError(400, f"{where}: missing (every turn needs text content)", param=where)
        content = m["content"]
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"{where}.{j}: only text content parts are supported "
                                        f"(got type {kind!r}); the local engine has no vision input", param=where)
                check_text(part["text"], where)
        elif isinstance(content, str):
            check_text(content, where)
        else:
            raise ApiError(400, f"{where}: must be a string or a list of text parts", param=where)
        for key in ("role", "name"):
            if isinstance(m.get(key), str):
                check_text(m[key], f"messages.{i}.{key}")


# ---- the guard in front of every route, and the error handlers ------------------


class _BodyTooLarge(HTTPException):
    """Raised from receive(): an HTTPException so FastAPI's body reader passes it through."""

    def __init__(self):
        super().__init__(413, f"request body over {MAX_BODY_BYTES} bytes")


class Guard:
    """Pure ASGI middleware: API key, body cap counted while reading (a chunked upload has no
    Content-Length to check), and the in-flight limit. Pure ASGI, unlike BaseHTTPMiddleware,
    so `request.is_disconnected()` still sees the client leave."""

    def __init__(self, app, engine):  # a local_engine.Engine
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        args, engine = self.engine.args, self.engine
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if (scope["path"] != "/health" and args.api_key
                and headers.get("authorization") != f"Bearer {args.api_key}"):
            return await error_response(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                        "AuthenticationError")(scope, receive, send)
        size = headers.get("content-length", "")
        too_large = f"request body over {MAX_BODY_BYTES} bytes"
        if size.isdigit() and int(size) > MAX_BODY_BYTES:
            return await error_response(413, too_large, ERROR_KINDS[413])(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise _BodyTooLarge
            return message

        started = False
        counted = scope["method"] == "POST"

        def leave() -> None:
            """The request is done: it leaves `in_flight` once, before its last byte is sent, so a
            client that has the whole reply never sees it still counted."""
            nonlocal counted
            if counted:
                counted = False
                engine.in_flight -= 1
                engine.metrics.running.set(engine.in_flight)

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                leave()
            await send(message)

        if counted:
            if engine.in_flight >= args.max_concurrency:
                return await error_response(503, f"server busy: {args.max_concurrency} requests in flight "
                                            "(--max-concurrency); retry later", ERROR_KINDS[503])(scope, receive, send)
            engine.in_flight += 1
            engine.metrics.running.set(engine.in_flight)
        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                leave()
                await error_response(413, too_large, ERROR_KINDS[413])(scope, receive, send)
        finally:
            leave()


def install_error_handlers(app: FastAPI) -> None:
    """Every error this server answers, in OpenAI's shape: ours, FastAPI's and bad request bodies."""

    @app.exception_handler(ApiError)
    async def _api_error(_r: Request, e: ApiError):
        return error_response(e.status, e.message, e.kind, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_r: Request, e: StarletteHTTPException):  # 404, 405, unreadable body
        kind = ERROR_KINDS.get(e.status_code, "BadRequestError" if e.status_code < 500 else "InternalServerError")
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, e: RequestValidationError):
        errors = e.errors()
        msg = "; ".join(f"{'.'.join(str(p) for p in x['loc'][1:]) or 'body'}: {x['msg']}" for x in errors)
        param = ".".join(str(p) for p in errors[0]["loc"][1:]) or None if errors else None
        return error_response(400, msg, "BadRequestError", param)
