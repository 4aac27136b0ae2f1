"""Start the server a stage needs (or reuse a given endpoint) for the stage's duration."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dspark_kit.engines import Role, ServerPlan
from dspark_kit.recipe import Recipe


def server_plan(recipe: Recipe, role: Role, port: int | None = None, checkpoint: str | Path | None = None,
                workdir: Path | None = None, engine: str | None = None, api_key: str | None = None) -> ServerPlan:
    """The plan for `role` on `engine` (default: the recipe's serve.engine).

    api_key goes to the server in its environment (DSPARK_KIT_API_KEY / VLLM_API_KEY), never argv.
    """
    engine = engine or recipe.serve.engine
    if engine == "local":
        from dspark_kit.engines.local import plan_local  # lazily: pulls in the local server stack

        return plan_local(recipe, role, port=port, checkpoint=str(checkpoint) if checkpoint else None,
                          api_key=api_key)
    from dspark_kit.engines.vllm import plan_vllm

    plan = plan_vllm(recipe, role, engine=engine, port=port, checkpoint=checkpoint, workdir=workdir)
    if api_key:
        plan.env["VLLM_API_KEY"] = api_key  # vLLM reads it when --api-key is not given
    return plan


def regen_server_plan(recipe: Recipe, api_key: str | None = None) -> ServerPlan:
    """The chat server regen starts when no endpoint is given: the recipe's engine, on a free port."""
    from dspark_kit.lifecycle import free_port

    if recipe.serve.engine == "local":
        from dspark_kit.engines.local import plan_local

        return plan_local(recipe, "chat", api_key=api_key)
    return server_plan(recipe, "chat", port=free_port(), api_key=api_key)


@contextmanager
def running_server(recipe: Recipe, role: Role, workdir: Path, port: int | None = None,
                   checkpoint: str | Path | None = None) -> Iterator[str]:
    """Yield the base URL of a healthy server for `role`; stop it afterwards."""
    from dspark_kit.lifecycle import ManagedServer

    plan = server_plan(recipe, role, port=port, checkpoint=checkpoint, workdir=workdir)
    log = Path(workdir) / "logs" / f"{role}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with ManagedServer(plan, log) as srv:
        srv.wait_healthy(recipe.serve.startup_timeout)
        yield plan.base_url


@contextmanager
def hidden_state_server(recipe: Recipe, workdir: Path) -> Iterator[str]:
    """hidden_states.endpoint when given, else a started extraction server."""
    if recipe.hidden_states.endpoint:
        yield recipe.hidden_states.endpoint
        return
    from dspark_kit.lifecycle import free_port

    with running_server(recipe, "hidden-states", workdir, port=free_port()) as url:
        yield url
