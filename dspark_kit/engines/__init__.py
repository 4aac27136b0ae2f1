"""Engines behind one small interface.

An engine turns a recipe + role into a `ServerPlan` (argv + env + where it
listens); `dspark_kit.engines.lifecycle` starts, health-checks and stops any plan the
same way. Roles: `chat` (regen / bench without a draft), `hidden-states`
(verifier hidden-state extraction, docs/CONCEPTS.md#the-hidden-state-server), `spec` (verifier + DSpark
draft). Engines: `local` (our FastAPI server, CPU/CUDA/NPU via transformers),
`vllm` (CUDA), `vllm-ascend` (NPU), `llama.cpp` (CPU, GGUF: engines/llamacpp.py; roles chat and spec).

Layer 4: may import core, data/, specdec/, compat/ and distributed/; never the resolver package
(a stage asks it and hands an engine plain values: serve_inputs.py's records), measure/, stages/
or cli/. local/ holds the local engine.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from dspark_kit.recipe import ENGINES, ROLES

if TYPE_CHECKING:
    from dspark_kit.engines.ports import Port

# the environment variable a server's API key travels in (never argv: `ps` would show it); the local
# server reads it, regen's client sends it, `serve --api-key` defaults to it
API_KEY_ENV = "DSPARK_KIT_API_KEY"


def api_key_from_env() -> str | None:
    import os

    return os.environ.get(API_KEY_ENV) or None


Role = Literal[ROLES]
EngineName = Literal[ENGINES]


def openai_base_url(url: str) -> str:
    """An OpenAI-compatible base URL as clients want it: scheme, no trailing slash, ending in /v1."""
    url = url.strip().rstrip("/")
    url = url if "://" in url else "http://" + url
    return url if url.endswith("/v1") else url + "/v1"


def tool_call_flags(parser: str | None, role: str) -> list[str]:
    """serve.tool_call_parser on the servers that answer chats (vLLM's flags; the local engine takes the same)."""
    return ["--enable-auto-tool-choice", "--tool-call-parser", parser] if parser and role != "hidden-states" else []


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    """A command and its env as one copy-pasteable line (for --dry-run, logs and errors).

    Secrets (API keys, tokens) are shown as *** (dspark_kit.redact): this line is printed and recorded.
    """
    from dspark_kit.redact import MASK, redact_argv, redact_env

    def quote(word: str) -> str:  # *** stays readable as the placeholder it is
        return word if word == MASK or word.endswith("=" + MASK) else shlex.quote(word)

    prefix = " ".join(f"{k}={quote(v)}" for k, v in sorted(redact_env(env).items()))
    return (prefix + " " if prefix else "") + " ".join(quote(a) for a in redact_argv(argv))


@dataclass
class LaunchPlan:
    """A process that is not a server (a trainer, an offline hidden-state writer): argv + env."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell_line(self) -> str:
        return shell_line(self.argv, self.env)


@dataclass
class ServerPlan:
    argv: list[str]
    host: str
    port: int
    env: dict[str, str] = field(default_factory=dict)  # added to os.environ
    health_path: str = "/health"
    notes: list[str] = field(default_factory=list)  # warnings to show the user
    decisions: list[str] = field(default_factory=list)  # what was decided and why (informational)
    port_decision: Port | None = None  # where `port` came from (engines/ports.py); None: given by the caller
    # more ports the process listens on, checked free before it starts: {recipe key (and what): port}
    other_ports: dict[str, int] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shell_line(self) -> str:
        return shell_line(self.argv, self.env)
