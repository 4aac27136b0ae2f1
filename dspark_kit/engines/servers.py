"""Start the server a stage needs (or reuse a given endpoint) for the stage's duration."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dspark_kit.engines import Role, ServerPlan
from dspark_kit.resolved import Resolved

if TYPE_CHECKING:
    from dspark_kit.engines.lifecycle import ManagedServer


def server_plan(res: Resolved, role: Role, port: int | None = None, api_key: str | None = None,
                host: str | None = None) -> ServerPlan:
    """The plan for `role` on the resolver's engine (default: the recipe's serve.engine).

    api_key goes to the server in its environment (DSPARK_KIT_API_KEY / VLLM_API_KEY), never argv;
    `host` replaces serve.host (a server other machines reach binds 0.0.0.0).
    """
    if res.engine == "local":
        from dspark_kit.engines.local import plan_local  # lazily: pulls in the local server stack

        return plan_local(res, role, port=port, host=host, api_key=api_key)
    from dspark_kit.engines.vllm import plan_vllm

    plan = plan_vllm(res, role, port=port, host=host)
    if api_key:
        plan.env["VLLM_API_KEY"] = api_key  # vLLM reads it when --api-key is not given
    return plan


def regen_server_plan(res: Resolved, api_key: str | None = None) -> ServerPlan:
    """The chat server regen starts when no endpoint is given: the recipe's engine, on a free port."""
    from dspark_kit.engines.lifecycle import free_port

    if res.engine == "local":
        from dspark_kit.engines.local import plan_local

        # thinking on: the engine hands reasoning back split out, as vLLM --reasoning-parser qwen3 does
        extra = ["--reasoning-parser", "qwen3"] if res.recipe.verifier.thinking else None
        return plan_local(res, "chat", port=free_port(res.recipe.serve.host), api_key=api_key, extra_args=extra)
    return server_plan(res, "chat", port=free_port(res.recipe.serve.host), api_key=api_key)


@contextmanager
def managed_server(res: Resolved, role: Role, port: int | None = None) -> Iterator[ManagedServer]:
    """A healthy server for `role` (its log in the run's logs/); stopped afterwards."""
    from dspark_kit.engines.lifecycle import ManagedServer

    plan = server_plan(res, role, port=port)
    log = res.run.server_log(role)
    log.parent.mkdir(parents=True, exist_ok=True)
    with ManagedServer(plan, log) as srv:
        srv.wait_healthy(res.recipe.serve.startup_timeout)
        yield srv


@contextmanager
def running_server(res: Resolved, role: Role, port: int | None = None) -> Iterator[str]:
    """Yield the base URL of a healthy server for `role`; stop it afterwards."""
    with managed_server(res, role, port=port) as srv:
        yield srv.base_url


@contextmanager
def mooncake_master(res: Resolved) -> Iterator[ManagedServer | None]:
    """mooncake_master while the stage runs, on the node that starts it (transport mooncake); else nothing."""
    mc = res.mooncake
    if mc is None or mc.start_on_node != res.recipe.train.node_rank:
        yield None
        return
    from dspark_kit.engines.lifecycle import ManagedServer

    plan = ServerPlan(argv=mc.master_argv(), host="127.0.0.1", port=mc.admin_port)  # /health on its admin port
    log = res.run.mooncake_log
    log.parent.mkdir(parents=True, exist_ok=True)
    with ManagedServer(plan, log) as srv:
        srv.wait_healthy(res.recipe.serve.startup_timeout)
        yield srv


@dataclass
class HiddenStateEndpoint:
    """Where hidden states come from: hidden_states.endpoint, or a server this command started."""

    url: str
    server: ManagedServer | None = None  # None: the recipe's endpoint, not ours to watch

    def gone(self) -> str | None:
        """One line when the server this command started has exited (None while it runs)."""
        if self.server is None or self.server.alive():
            return None
        return (f"the hidden-state server {self.url} exited with code {self.server.proc.returncode} "
                f"({self.server.plan.argv[0]} ...; log {self.server.log_path})")


@contextmanager
def hidden_state_server(res: Resolved) -> Iterator[HiddenStateEndpoint]:
    """hidden_states.endpoint when given, else a started extraction server."""
    if res.recipe.hidden_states.endpoint:
        yield HiddenStateEndpoint(res.recipe.hidden_states.endpoint)
        return
    from dspark_kit.engines.lifecycle import free_port

    with managed_server(res, "hidden-states", port=free_port()) as srv:
        yield HiddenStateEndpoint(srv.base_url, srv)
