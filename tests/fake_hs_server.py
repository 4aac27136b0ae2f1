"""A stand-in extraction server speaking vLLM's extract_hidden_states protocol, with planted faults.

/v1/completions with `prompt` = token ids answers like vLLM's file connector
(`kv_transfer_params.hidden_states_path`, `prompt_token_ids`) and writes the
file: random hidden states of the right shape. A prompt listed in `faults`
gets the fault instead: "no-path" (no kv_transfer_params) or "wrong-ids" (a
file whose token_ids differ from the request).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self

import torch
from safetensors.torch import save_file


class FakeHiddenStateServer:
    def __init__(self, model: str, storage: Path, layers: int, hidden: int, faults: dict[tuple, str]):
        self.model, self.storage, self.layers, self.hidden = model, Path(storage), layers, hidden
        self.faults = faults
        self.requests: list[list[int]] = []
        self.storage.mkdir(parents=True, exist_ok=True)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def completion(self, ids: list[int]) -> dict:
        self.requests.append(ids)
        fault = self.faults.get(tuple(ids))
        body = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None,
                             "prompt_token_ids": ids}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}}
        if fault == "no-path":
            return body
        path = self.storage / f"{body['id']}.safetensors"
        token_ids = torch.tensor(ids, dtype=torch.long)
        if fault == "wrong-ids":
            token_ids = token_ids.flip(0) + 1
        save_file({"hidden_states": torch.randn(len(ids), self.layers, self.hidden), "token_ids": token_ids},
                  str(path))
        body["kv_transfer_params"] = {"hidden_states_path": str(path)}
        return body

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.rstrip("/") == "/health":
                    return self._send(200, {})
                if self.path.rstrip("/") == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})
                self._send(404, {"error": "not found"})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path.rstrip("/") != "/v1/completions" or not isinstance(req.get("prompt"), list):
                    return self._send(400, {"error": "expected /v1/completions with token ids"})
                self._send(200, server.completion([int(t) for t in req["prompt"]]))

        return Handler

    def __enter__(self) -> Self:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
