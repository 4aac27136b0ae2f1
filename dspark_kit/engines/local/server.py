"""The local engine: an OpenAI-compatible HTTP server over transformers.

Run: `python -m dspark_kit.engines.local.server --model DIR --role chat --port 8000`.
It speaks the subset of vLLM's API the pipeline uses, with vLLM's names, so
every client works unchanged against vLLM later:
  GET /health (no auth), GET /v1/models, POST /v1/chat/completions,
  POST /v1/completions (both also as server-sent events with `stream: true`),
  GET /metrics (vLLM Prometheus counter names).
Role `hidden-states` mirrors vLLM's extract_hidden_states + file connector
(docs/CONCEPTS.md#the-hidden-state-server): a completions request with prompt token ids writes
`<storage>/<request-id>.safetensors` and answers with
`kv_transfer_params.hidden_states_path`; role `spec` decodes with a DSpark draft.
One decoding thread serves requests in turn (the tiny model is faster that way
on 2 cores than interleaving), so /health stays responsive while it works.

Here: the routes and the command line. The model side (limits, decoding,
hidden-state files) is local_engine.py; the request schema, input checks, the
guard (API key, body cap, in-flight limit) and the error shape are local/api.py;
the /metrics names are prom.py's.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from dspark_kit.data.reasoning_formats import PARSERS as REASONING_PARSERS
from dspark_kit.engines import api_key_from_env
from dspark_kit.engines.local.api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Guard,
    check_messages,
    check_text,
    install_error_handlers,
)
from dspark_kit.engines.local.engine import Engine, build_generator
from dspark_kit.engines.local.stream import TextStream, stream_events
from dspark_kit.engines.local.tools import PARSERS, refusal, split_tool_calls
from dspark_kit.recipe import ROLES
from dspark_kit.recipe.schema import DEFAULT_SERVE_PORT


def reply_splitter(parser: str | None):
    """--reasoning-parser NAME: the reply split as that vLLM parser answers it (the format's
    split_reply, data/reasoning_formats.py); None without a parser."""
    return REASONING_PARSERS[parser].split_reply if parser else None


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="dspark-kit local engine", docs_url=None, redoc_url=None)
    args = engine.args
    app.add_middleware(Guard, engine=engine)
    install_error_handlers(app)

    def streamed(req, request: Request, ids: list[int], max_tokens: int, rid: str, chat: bool,
                 split=None) -> StreamingResponse:
        """`stream: true`: server-sent events as vLLM sends them (local/stream.py)."""
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        text = TextStream(lambda t: engine.tok.decode(t, skip_special_tokens=False), engine.request_stop_ids(req),
                          stops, field="content" if chat else "text", split=split)
        events = stream_events(engine.stream(ids, req, max_tokens, request), text, chat=chat, rid=rid,
                               created=int(time.time()), model=engine.served_name, prompt_ids=ids, req=req)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        body, ctype = engine.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "dspark-kit", "root": args.model,
            "max_model_len": engine.max_len} for name in engine.served_names]}

    def chat_ids(req: ChatRequest) -> list[int]:
        from dspark_kit.data.chat import encode, render
        from dspark_kit.data.conversations import ConversationError, normalize, row_tools

        try:
            msgs = normalize({"messages": req.messages})
            tools = row_tools({"tools": req.tools})
        except ConversationError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        thinking = bool(req.chat_template_kwargs.get("enable_thinking", True))
        if req.continue_final_message:  # speculators' re-render of a finished conversation
            if req.add_generation_prompt:
                raise ApiError(400, "continue_final_message and add_generation_prompt are exclusive")
            text = engine.tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True,
                                                  enable_thinking=thinking, tools=tools)
        else:
            text = render(engine.tok, msgs, thinking, add_generation_prompt=req.add_generation_prompt, tools=tools)
        return encode(engine.tok, text)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        engine.check_model(req)
        check_messages(req.messages)
        if not isinstance(req.chat_template_kwargs.get("enable_thinking", True), bool):
            raise ApiError(400, "chat_template_kwargs.enable_thinking: must be true or false")
        calls_tools = bool(req.tools) and req.tool_choice != "none"
        if why := refusal(req.tools, req.tool_choice, bool(getattr(args, "tool_call_parser", None))):
            raise ApiError(400, why, param="tool_choice" if why.startswith("tool_choice") else "tools")
        if calls_tools and req.stream:
            raise ApiError(400, "stream: tool calls are answered whole on the local engine (set stream false)",
                           param="stream")
        engine.check_text_size(sum(len(c) if isinstance(c := m.get("content") or "", str) else
                                   sum(len(p["text"]) for p in c) for m in req.messages), "messages")
        ids = await engine.tokenize(chat_ids, req)
        max_tokens = engine.default_max_tokens(ids, req)
        engine.check_prompt(ids, max_tokens)
        split = reply_splitter(getattr(args, "reasoning_parser", None))
        if req.stream:
            return streamed(req, request, ids, max_tokens, f"chatcmpl-{uuid.uuid4().hex}", chat=True, split=split)
        out = await engine.run(engine.decode, ids, req, max_tokens, request=request)
        message = {"role": "assistant", "content": out["text"]}
        if split:
            message.update(split(out["text"]))
        finish = out["finish_reason"]
        if calls_tools and message["content"]:
            message["content"], calls = split_tool_calls(message["content"])
            if calls:  # vLLM: finish_reason "tool_calls" when the reply made calls
                message["tool_calls"], finish = calls, "tool_calls"
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
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
        if req.stream:  # (role hidden-states refuses stream in check_model)
            return streamed(req, request, ids, max_tokens, rid, chat=False)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspark_kit.engines.local.server",
                                description="OpenAI-compatible local engine (vLLM API subset).")
    p.add_argument("--model", required=True, help="verifier HF directory")
    p.add_argument("--role", choices=list(ROLES), default="chat")
    p.add_argument("--draft", help="DSpark checkpoint dir (role spec)")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--draft-window-size", type=int, default=None)
    p.add_argument("--layer-ids", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=None, help="exported layer ids, comma separated (targets + N)")
    p.add_argument("--storage-path", default=None, help="hidden-state files go here (role hidden-states)")
    p.add_argument("--hidden-states-dtype", choices=["bfloat16", "float32", "fp8"], default="bfloat16")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_SERVE_PORT)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model ids to answer to, listed in this order by /v1/models (default: --model), as vLLM")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split the reasoning out of chat replies into message.reasoning_content, as that vLLM "
                        "parser does (qwen3: <think>..</think>; openai_gptoss: Harmony's analysis/final channels)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="answer requests with tools: calls parsed out of the reply (needs --tool-call-parser), as vLLM")
    p.add_argument("--tool-call-parser", choices=list(PARSERS), default=None,
                   help="hermes: <tool_call>{json}</tool_call> blocks (Qwen3's format) -> message.tool_calls")
    p.add_argument("--api-key", default=api_key_from_env())
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
    if args.enable_auto_tool_choice != bool(args.tool_call_parser):
        p.error("--enable-auto-tool-choice and --tool-call-parser go together (as vLLM)")
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
