"""The local engine: an OpenAI-compatible HTTP server over transformers.

Run: `python -m dspark_kit.engines.local_server --model DIR --role chat --port 8000`.
It speaks the subset of vLLM's API the pipeline uses, with vLLM's names, so
every client works unchanged against vLLM later:
  GET /health (no auth), GET /v1/models, POST /v1/chat/completions,
  POST /v1/completions, GET /metrics (vLLM Prometheus counter names).
Role `hidden-states` mirrors vLLM's extract_hidden_states + file connector
(docs/CONCEPTS.md#the-hidden-state-server): a completions request with prompt token ids writes
`<storage>/<request-id>.safetensors` and answers with
`kv_transfer_params.hidden_states_path`; role `spec` decodes with a DSpark draft.
One decoding thread serves requests in turn (the tiny model is faster that way
on 2 cores than interleaving), so /health stays responsive while it works.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from dspark_kit.engines.local_api import (
    DISCONNECT_POLL_S,
    ERROR_KINDS,
    MAX_BODY_BYTES,
    REQUEST_ID_RE,
    SAMPLING_EPS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    OpenAIRequest,
    check_extras,
    check_messages,
    check_text,
    error_response,
)
from dspark_kit.recipe import ROLES


class EngineMetrics:
    """vLLM's Prometheus names (docs/CONCEPTS.md#acceptance-figures) so bench code reads either engine."""

    def __init__(self, model_name: str, spec: bool):
        from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics

        disable_created_metrics()  # vLLM exposes no *_created series either
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(name, doc, [*names, *extra], registry=self.registry)

        self.prompt = counter("vllm:prompt_tokens", "Prefill tokens processed.").labels(**labels)
        self.generation = counter("vllm:generation_tokens", "Tokens generated.").labels(**labels)
        self.running = Gauge("vllm:num_requests_running", "Requests in flight.", names,
                             registry=self.registry).labels(**labels)
        self.spec = spec
        if spec:
            self.drafts = counter("vllm:spec_decode_num_drafts", "Draft proposals.").labels(**labels)
            self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens.").labels(**labels)
            self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Accepted tokens.").labels(**labels)
            self._per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", ("position",))
            self._labels = labels

    def observe(self, prompt_tokens: int, res) -> None:
        self.prompt.inc(prompt_tokens)
        self.generation.inc(len(res.token_ids))
        if self.spec:
            self.drafts.inc(res.num_drafts)
            self.draft_tokens.inc(res.num_draft_tokens)
            self.accepted.inc(res.num_accepted_tokens)
            for pos, n in enumerate(res.accepted_per_pos):
                self._per_pos.labels(**self._labels, position=str(pos)).inc(n)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _cut_at_stop(text: str, stop: str | list[str] | None) -> tuple[str, bool]:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    hits = [text.index(s) for s in stops if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


class Engine:
    """Model, tokenizer, generator and the bookkeeping one server needs."""

    def __init__(self, args: argparse.Namespace, model, tokenizer, generator, config=None):
        # role spec passes model=None + the config: its generator holds its own verifier
        self.args, self.model, self.tok, self.generator = args, model, tokenizer, generator
        config = config or model.config
        self.served_name = args.served_model_name or args.model
        self.max_len = int(getattr(config, "max_position_embeddings", 4096))
        if getattr(args, "max_model_len", None):  # the recipe's serve.max_model_len, as vLLM's flag
            self.max_len = min(self.max_len, args.max_model_len)
        self.vocab = int(config.vocab_size)
        stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
        self.stop_ids = frozenset(i for i in stop if isinstance(i, int) and i >= 0)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        # tokenizing a large prompt takes seconds: never on the event loop, never behind decoding
        self.tok_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.in_flight = 0
        self._longest_token: int | None = None
        self.aborted = 0  # requests whose client left mid-decode (decoding stopped for them)
        self.metrics = EngineMetrics(self.served_name, spec=args.role == "spec")
        self.storage = Path(args.storage_path).resolve() if args.storage_path else None

    def check_model(self, req: OpenAIRequest) -> None:
        if req.model is not None and req.model != self.served_name:
            raise ApiError(404, f"The model `{req.model}` does not exist; this server serves "
                                f"`{self.served_name}` (GET /v1/models)", "NotFoundError")
        if req.n != 1:
            raise ApiError(400, "n: the local engine returns exactly one choice (n=1)")
        if req.stream:
            raise ApiError(400, "stream: not supported by the local engine; send stream=false")
        check_extras(req)
        if self.args.role == "spec" and req.top_p < 1.0 and req.temperature >= SAMPLING_EPS:
            raise ApiError(400, "top_p: role spec samples from the verifier without nucleus filtering; "
                                "send top_p=1 (or temperature=0)", param="top_p")
        for i, stop in enumerate([req.stop] if isinstance(req.stop, str) else (req.stop or [])):
            check_text(stop, f"stop.{i}")

    def check_prompt(self, ids: list[int], max_tokens: int) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab]
        if bad:
            raise ApiError(400, f"prompt: token ids {bad[:5]} outside [0, {self.vocab})")
        if not ids:
            raise ApiError(400, "prompt: empty after tokenization", param="prompt")
        if len(ids) >= self.max_len:
            raise ApiError(400, f"prompt ({len(ids)} tokens) leaves no room to generate: the maximum "
                                f"context length is {self.max_len} tokens", param="messages")
        if len(ids) + max_tokens > self.max_len:
            raise ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                f"the maximum context length {self.max_len}; shorten or lower max_tokens",
                           param="max_tokens")

    def check_text_size(self, chars: int, where: str) -> None:
        """Refuse text that cannot fit before tokenizing it (seconds for megabytes): no token
        covers more than the longest vocabulary entry's characters."""
        if self._longest_token is None:
            self._longest_token = max((len(t) for t in self.tok.get_vocab()), default=1) or 1
        if chars > self.max_len * self._longest_token:
            raise ApiError(400, f"{where}: {chars} characters cannot fit the maximum context length "
                                f"{self.max_len} tokens", param=where)

    def default_max_tokens(self, ids: list[int], req: OpenAIRequest) -> int:
        given = req.max_tokens if req.max_tokens is not None else getattr(req, "max_completion_tokens", None)
        return given if given is not None else max(1, self.max_len - len(ids))

    async def tokenize(self, fn, *a):
        return await asyncio.get_running_loop().run_in_executor(self.tok_pool, fn, *a)

    async def run(self, fn, *a, request: Request | None = None):
        """fn(*a, cancel) on the decode thread; set `cancel` when the client disconnects."""
        cancel = threading.Event()
        fut = asyncio.get_running_loop().run_in_executor(self.pool, fn, *a, cancel)
        if request is None:
            return await fut
        while True:
            done, _ = await asyncio.wait({fut}, timeout=DISCONNECT_POLL_S)
            if done:
                return fut.result()
            if await request.is_disconnected():
                cancel.set()  # the generator stops at its next step; a queued request never starts
                self.aborted += 1
                return await fut

    def decode(self, ids: list[int], req: OpenAIRequest, max_tokens: int, cancel: threading.Event) -> dict[str, Any]:
        kwargs = {"top_p": req.top_p} if req.top_p < 1.0 and self.args.role != "spec" else {}
        if cancel.is_set():
            return {"text": "", "token_ids": [], "finish_reason": "abort"}
        temperature = req.temperature if req.temperature >= SAMPLING_EPS else 0.0  # vLLM: below eps = greedy
        stop_ids = frozenset() if req.ignore_eos else self.stop_ids
        res = self.generator.generate(ids, max_tokens, temperature=temperature,
                                      seed=req.seed, stop_ids=stop_ids, cancel=cancel, **kwargs)
        shown = res.token_ids[:-1] if res.token_ids and res.token_ids[-1] in stop_ids else res.token_ids
        text, stopped = _cut_at_stop(self.tok.decode(shown, skip_special_tokens=False), req.stop)
        self.metrics.observe(len(ids), res)
        out = {"text": text, "token_ids": res.token_ids, "finish_reason": "stop" if stopped else res.finish_reason}
        if self.args.role == "spec":  # the engine's own per-request count (a dspark-kit extension)
            out["spec_decode"] = {"num_drafts": res.num_drafts, "num_draft_tokens": res.num_draft_tokens,
                                  "num_accepted_tokens": res.num_accepted_tokens,
                                  "accepted_per_pos": list(res.accepted_per_pos)}
        return out

    def request_file(self, request_id: str) -> Path:
        if self.storage is None:
            raise ApiError(400, "hidden states: server started without --storage-path")
        if not REQUEST_ID_RE.fullmatch(request_id):
            raise ApiError(400, f"request_id {request_id!r}: use letters, digits, '.', '_', '-' only")
        path = (self.storage / f"{request_id}.safetensors").resolve()
        if path.parent != self.storage:
            raise ApiError(400, f"request_id {request_id!r}: escapes the storage directory")
        return path

    def write_hidden_states(self, ids: list[int], path: Path, cancel: threading.Event | None = None) -> int:
        import torch
        from safetensors.torch import save_file

        from dspark_kit.engines.verifier_generator import extract_hidden_states

        hs, next_token = extract_hidden_states(self.model, ids, self.args.layer_ids)
        tensors = {"hidden_states": hs.to(getattr(torch, self.args.hidden_states_dtype)).cpu().contiguous(),
                   "token_ids": torch.tensor(ids, dtype=torch.int64)}
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = f"{path}.lock"
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:  # readers (hs_connectors) wait on this lock before loading
            fcntl.flock(fd, fcntl.LOCK_EX)
            tmp = path.with_name(path.name + ".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            os.remove(lock)  # written before we answer: no reader can be waiting on it
        return next_token


def split_reasoning_like_vllm(text: str) -> dict[str, str | None]:
    """--reasoning-parser qwen3: `<think>R</think>C` -> reasoning_content R, content C (text as
    generated, no stripping; content None when empty), as vLLM's parser answers. A reply cut off
    before `</think>` is all reasoning. `reasoning` (vLLM's newer name) carries the same text."""
    head, sep, tail = text.partition("<think>")
    rest = tail if sep else head
    if "</think>" in rest:
        reasoning, _, content = rest.partition("</think>")
    elif sep:
        reasoning, content = rest, ""
    else:
        return {"content": text, "reasoning_content": None, "reasoning": None}
    return {"content": content or None, "reasoning_content": reasoning, "reasoning": reasoning}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _BodyTooLarge(HTTPException):
    """Raised from receive(): an HTTPException so FastAPI's body reader passes it through."""

    def __init__(self):
        super().__init__(413, f"request body over {MAX_BODY_BYTES} bytes")


class Guard:
    """Pure ASGI middleware: API key, body cap counted while reading (a chunked upload has no
    Content-Length to check), and the in-flight limit. Pure ASGI, unlike BaseHTTPMiddleware,
    so `request.is_disconnected()` still sees the client leave."""

    def __init__(self, app, engine: Engine):
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

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        counted = scope["method"] == "POST"
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
                await error_response(413, too_large, ERROR_KINDS[413])(scope, receive, send)
        finally:
            if counted:
                engine.in_flight -= 1
                engine.metrics.running.set(engine.in_flight)


def create_app(engine: Engine) -> FastAPI:
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="dspark-kit local engine", docs_url=None, redoc_url=None)
    args = engine.args
    app.add_middleware(Guard, engine=engine)

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

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        body, ctype = engine.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": engine.served_name, "object": "model", "created": int(time.time()),
            "owned_by": "dspark-kit", "root": args.model, "max_model_len": engine.max_len}]}

    def chat_ids(req: ChatRequest) -> list[int]:
        from dspark_kit.data.chat import encode, render
        from dspark_kit.data.conversations import ConversationError, normalize

        try:
            msgs = normalize({"messages": req.messages})
        except ConversationError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        thinking = bool(req.chat_template_kwargs.get("enable_thinking", True))
        if req.continue_final_message:  # speculators' re-render of a finished conversation
            if req.add_generation_prompt:
                raise ApiError(400, "continue_final_message and add_generation_prompt are exclusive")
            text = engine.tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True,
                                                  enable_thinking=thinking)
        else:
            text = render(engine.tok, msgs, thinking, add_generation_prompt=req.add_generation_prompt)
        return encode(engine.tok, text)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        engine.check_model(req)
        check_messages(req.messages)
        if not isinstance(req.chat_template_kwargs.get("enable_thinking", True), bool):
            raise ApiError(400, "chat_template_kwargs.enable_thinking: must be true or false")
        engine.check_text_size(sum(len(m["content"]) if isinstance(m["content"], str) else
                                   sum(len(p["text"]) for p in m["content"]) for m in req.messages), "messages")
        ids = await engine.tokenize(chat_ids, req)
        max_tokens = engine.default_max_tokens(ids, req)
        engine.check_prompt(ids, max_tokens)
        out = await engine.run(engine.decode, ids, req, max_tokens, request=request)
        message = {"role": "assistant", "content": out["text"]}
        if getattr(args, "reasoning_parser", None):
            message.update(split_reasoning_like_vllm(out["text"]))
        choice = {"index": 0, "message": message, "finish_reason": out["finish_reason"], "logprobs": None}
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": engine.served_name, "choices": [choice],
                "usage": _usage(len(ids), len(out["token_ids"]))}
        if req.return_token_ids:
            body["prompt_token_ids"], choice["token_ids"] = ids, out["token_ids"]
        if "spec_decode" in out:
            body["spec_decode"] = out["spec_decode"]
        return body

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        from dspark_kit.data.chat import encode

        engine.check_model(req)
        if isinstance(req.prompt, list):
            ids = req.prompt
        else:
            check_text(req.prompt, "prompt")
            engine.check_text_size(len(req.prompt), "prompt")
            ids = await engine.tokenize(encode, engine.tok, req.prompt)
        max_tokens = engine.default_max_tokens(ids, req)
        engine.check_prompt(ids, max_tokens)
        rid = req.request_id or request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()),
                                "model": engine.served_name}
        if args.role == "hidden-states":
            path = engine.request_file(rid)
            await engine.run(engine.write_hidden_states, ids, path)
            body["kv_transfer_params"] = {"hidden_states_path": str(path)}
        out = await engine.run(engine.decode, ids, req, max_tokens, request=request)
        choice = {"index": 0, "text": out["text"], "finish_reason": out["finish_reason"], "logprobs": None}
        if req.return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = ids, out["token_ids"]
        body["choices"], body["usage"] = [choice], _usage(len(ids), len(out["token_ids"]))
        return body

    return app


def build_generator(args, model):
    from dspark_kit.engines.verifier_generator import VerifierGenerator

    if args.role != "spec":
        return VerifierGenerator(model, token_delay_s=args.token_delay_ms / 1000)
    if not args.draft or not args.num_speculative_tokens:
        raise SystemExit("--draft and --num-speculative-tokens: role spec needs a DSpark checkpoint and K "
                         "(`dspark-kit serve` decides K; see `dspark-kit recipe show`)")
    from dspark_kit.specdec.decoder import SpecGenerator  # lazy: heavy imports, only for role spec
    from dspark_kit.specdec.verifier import resolve_device

    return SpecGenerator.from_checkpoint(
        args.model, args.draft, num_speculative_tokens=args.num_speculative_tokens,
        draft_window_size=args.draft_window_size, device=resolve_device(args.device), dtype=args.dtype)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspark_kit.engines.local_server",
                                description="OpenAI-compatible local engine (vLLM API subset).")
    p.add_argument("--model", required=True, help="verifier HF directory")
    p.add_argument("--role", choices=list(ROLES), default="chat")
    p.add_argument("--draft", help="DSpark checkpoint dir (role spec)")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--draft-window-size", type=int, default=None)
    p.add_argument("--layer-ids", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=None, help="exported layer ids, comma separated (targets + N)")
    p.add_argument("--storage-path", default=None, help="hidden-state files go here (role hidden-states)")
    p.add_argument("--hidden-states-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--reasoning-parser", choices=["qwen3"], default=None,
                   help="split <think>..</think> out of chat replies into message.reasoning_content (as vLLM)")
    p.add_argument("--api-key", default=os.environ.get("DSPARK_KIT_API_KEY"))
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + max_tokens limit (default: the model's max_position_embeddings), as vLLM")
    p.add_argument("--max-concurrency", type=int, default=256, help="in-flight requests before 503")
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads (1 is fastest for small models next to other work; 0 = torch default)")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)  # tests
    return p


def check_extra_args(extra: list[str]) -> None:
    """serve.extra_args for the local engine: options it has pass through; anything else is an error."""
    import contextlib
    import io

    if not extra:
        return
    p = build_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            _, unknown = p.parse_known_args(["--model", "x", *extra])
    except SystemExit:
        raise ValueError(f"serve.extra_args {extra}: {err.getvalue().strip().splitlines()[-1]}") from None
    if unknown:
        known = sorted(o for a in p._actions for o in a.option_strings if o.startswith("--") and a.help
                       != argparse.SUPPRESS and o not in ("--help", "--model"))
        raise ValueError(f"serve.extra_args {unknown}: not options of the local engine (it accepts "
                         f"{', '.join(known)}); remove them, or use serve.engine vllm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.role == "hidden-states" and (not args.layer_ids or not args.storage_path):
        p.error("role hidden-states needs --layer-ids and --storage-path")
    return args


def watch_parent(poll_s: float = 0.5) -> None:
    """Exit when the kit process that started us is gone (it was SIGKILLed: no handler ran).

    Only when started by the kit (DSPARK_KIT_PARENT_PID set): a server run by hand stays up.
    """
    import signal

    expected = os.environ.get("DSPARK_KIT_PARENT_PID")
    if not expected or not expected.isdigit():
        return

    def loop() -> None:
        while True:
            if os.getppid() != int(expected):
                os.kill(os.getpid(), signal.SIGTERM)  # uvicorn stops listening at once
                time.sleep(5)
                os._exit(1)  # still here (a decode step holds on): go anyway
            time.sleep(poll_s)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from dspark_kit.specdec.verifier import load_tokenizer, load_verifier

    args = parse_args(argv)
    watch_parent()
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)  # oversubscribed OpenMP spins: 50x slower on 2 busy cores
    if args.role == "spec":
        from transformers import AutoConfig

        tok, config = load_tokenizer(args.model), AutoConfig.from_pretrained(args.model)
        engine = Engine(args, None, tok, build_generator(args, None), config=config)
    else:
        model, tok = load_verifier(args.model, args.device, args.dtype), load_tokenizer(args.model)
        engine = Engine(args, model, tok, build_generator(args, model))
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
