"""The local engine's model side: one verifier (or verifier + DSpark draft) behind the HTTP app.

`Engine` holds the model, tokenizer and decoder (a specdec.decoder `Generator`:
engines.verifier_generator.VerifierGenerator for roles chat / hidden-states,
specdec.decoder.SpecGenerator for role spec), checks a request against the
model's limits, and runs decoding on one thread so the event loop stays free.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import Request

from dspark_kit.data.chat import stop_token_ids
from dspark_kit.engines.local.api import (
    DISCONNECT_POLL_S,
    REQUEST_ID_RE,
    SAMPLING_EPS,
    ApiError,
    OpenAIRequest,
    check_extras,
    check_text,
)
from dspark_kit.engines.prom import EngineMetrics


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
        # as vLLM: every --served-model-name is answered to and listed; the first names replies and metrics
        self.served_names: list[str] = list(dict.fromkeys(args.served_model_name or [args.model]))
        self.served_name = self.served_names[0]
        self.max_len = int(getattr(config, "max_position_embeddings", 4096))
        if getattr(args, "max_model_len", None):  # the recipe's serve.max_model_len, as vLLM's flag
            self.max_len = min(self.max_len, args.max_model_len)
        self.vocab = int(config.vocab_size)
        self.stop_ids = stop_token_ids(tokenizer, args.model)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        # tokenizing a large prompt takes seconds: never on the event loop, never behind decoding
        self.tok_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.in_flight = 0
        self._longest_token: int | None = None
        self.aborted = 0  # requests whose client left mid-decode (decoding stopped for them)
        self.metrics = EngineMetrics(self.served_name, spec=args.role == "spec")
        self.storage = Path(args.storage_path).resolve() if args.storage_path else None

    def check_model(self, req: OpenAIRequest) -> None:
        if req.model is not None and req.model not in self.served_names:
            served = ", ".join(f"`{n}`" for n in self.served_names)
            raise ApiError(404, f"The model `{req.model}` does not exist; this server serves {served} "
                                "(GET /v1/models)", "NotFoundError")
        if req.n != 1:
            raise ApiError(400, "n: the local engine returns exactly one choice (n=1)")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options: only with stream=true (as vLLM)", param="stream_options")
        if req.stream and self.args.role == "hidden-states":
            raise ApiError(400, "stream: role hidden-states answers whole bodies (the file path comes with "
                                "the reply); send stream=false", param="stream")
        check_extras(req)
        if self.args.role == "spec" and req.top_p < 1.0 and req.temperature >= SAMPLING_EPS:
            raise ApiError(400, "top_p: role spec samples from the verifier without nucleus filtering; "
                                "send top_p=1 (or temperature=0)", param="top_p")
        for i, stop in enumerate([req.stop] if isinstance(req.stop, str) else (req.stop or [])):
            check_text(stop, f"stop.{i}")

    def request_stop_ids(self, req: OpenAIRequest) -> frozenset[int]:
        """Token ids that end this request's output (none with vLLM's ignore_eos)."""
        return frozenset() if req.ignore_eos else self.stop_ids

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

    async def stream(self, ids: list[int], req: OpenAIRequest, max_tokens: int,
                     request: Request | None = None) -> AsyncIterator[list[int] | dict]:
        """Decode on the decode thread, yielding each run of new token ids as the generator decides
        it, then decode()'s whole result (a dict) last. When the client leaves (or the iterator is
        closed early) decoding stops at its next step, as for a whole-body request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def on_tokens(tokens: list[int]) -> None:  # decode thread -> event loop, in order
            loop.call_soon_threadsafe(queue.put_nowait, list(tokens))

        fut = loop.run_in_executor(self.pool, self.decode, ids, req, max_tokens, cancel, on_tokens)
        fut.add_done_callback(lambda _f: queue.put_nowait(None))  # after every token already queued
        finished = False
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                while not (await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S))[0]:
                    if request is not None and await request.is_disconnected():
                        getter.cancel()
                        return  # finally: cancel decoding
                tokens = getter.result()
                if tokens is None:
                    break
                yield tokens
            finished = True
            yield fut.result()
        finally:
            if not finished:
                cancel.set()  # the generator stops at its next step; a queued request never starts
                self.aborted += 1

    def decode(self, ids: list[int], req: OpenAIRequest, max_tokens: int, cancel: threading.Event,
               on_tokens=None) -> dict[str, Any]:
        kwargs = {"top_p": req.top_p} if req.top_p < 1.0 and self.args.role != "spec" else {}
        if cancel.is_set():
            return {"text": "", "token_ids": [], "finish_reason": "abort"}
        temperature = req.temperature if req.temperature >= SAMPLING_EPS else 0.0  # vLLM: below eps = greedy
        stop_ids = self.request_stop_ids(req)
        if on_tokens is not None:
            kwargs["on_tokens"] = on_tokens
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
        from dspark_kit.specdec.hidden_state_files import file_tensors

        hs, next_token = extract_hidden_states(self.model, ids, self.args.layer_ids)
        tensors = {name: t.cpu() for name, t in file_tensors(hs, torch.tensor(ids, dtype=torch.int64),
                                                             self.args.hidden_states_dtype).items()}
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
