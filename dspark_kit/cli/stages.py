"""`prepare`, `hidden-states`, `train` and `run`: thin wrappers over dspark_kit.stages.pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from dspark_kit.cli import common
from dspark_kit.cli.vocabulary import option


def _stage_command(name: str, recipe: Path, set_: list[str] | None, workdir: Path | None, dry_run: bool,
                   json_out: bool, launcher: str = common.Launcher.local) -> None:
    """One stage as its own command: its plan (--dry-run), else plan, record and run it (--launcher
    slurm: as a batch job over the recipe's nodes)."""
    if launcher == "slurm":
        from dspark_kit.cli.slurm import launch

        launch(name, recipe, set_, workdir, dry_run, json_out)
        return
    res = common.resolve(common.load(recipe, set_), workdir, planning=dry_run)
    if dry_run:
        common.show_plan(common.stage_plan(name, res), json_out)
    else:
        _run_one(name, res, json_out)


def _run_one(name: str, res, json_out: bool) -> None:
    from dspark_kit.stages.pipeline import run_one_stage, stage_result
    from dspark_kit.stages.steps import REGISTRY

    try:
        summary = run_one_stage(res, name)  # recorded as `run` records it: a later `run` skips it
    except (ValueError, OSError, RuntimeError) as e:
        message = str(e)  # the stage is named once, whether or not the error already names it
        common.fail(message if message.startswith(f"{name}:") else f"{name}: {message}", 1)
    if json_out:
        common.emit_json(summary)
    else:  # the stage's one-line result, as `run` prints it; --json has every figure
        typer.echo(f"{name}: {stage_result(REGISTRY[name], summary)}")


def prepare(recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH, set_: common.SetOpt = None,
            workdir: common.WorkdirOpt = None, dry_run: common.DryRunOpt = False,
            json_out: common.JsonOpt = False) -> None:
    """Tokenize chats with the verifier's chat template; write DIR/prepared (speculators Arrow + token_freq.pt).

    Input: DIR/regen.jsonl when it exists, else the recipe's data.source. Loss mask = assistant
    tokens only; thinking mode: the one regen recorded per row, else verifier.thinking (a mixture's
    draw for the row). --dry-run prints what it tokenizes with which chat template, and where it writes.
    """
    _stage_command("prepare", recipe, set_, workdir, dry_run, json_out)


def hidden_states(recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH, set_: common.SetOpt = None,
                  workdir: common.WorkdirOpt = None, dry_run: common.DryRunOpt = False,
                  json_out: common.JsonOpt = False, launcher: common.LauncherOpt = common.Launcher.local) -> None:
    """Verifier hidden states for every prepared row -> DIR/prepared/hidden_states/hs_{i}.safetensors.

    Resumable: valid files are skipped, corrupt ones regenerated. Layer ids: the recipe's
    target_layer_ids plus the last layer N (vLLM convention, pre-norm). backend vllm: the
    recipe's engine serves extraction and speculators generate-offline-data writes the files
    (--dry-run prints the server and one command per node). A fine-tune on grown data:
    --set hidden_states.reuse_from=EARLIER_DIR links that run's files for rows with the same
    token ids first (same verifier, layers and dtypes, else one line), then computes the rest.
    """
    _stage_command("hidden-states", recipe, set_, workdir, dry_run, json_out, launcher)


def train(recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH, set_: common.SetOpt = None,
          workdir: common.WorkdirOpt = None, dry_run: common.DryRunOpt = False,
          json_out: common.JsonOpt = False, launcher: common.LauncherOpt = common.Launcher.local) -> None:
    """Train the DSpark draft with the real speculators trainer -> DIR/checkpoints.

    --dry-run prints the exact command (torchrun when train.nproc > 1 or nnodes > 1; one line
    per node), including device env such as ASCEND_RT_VISIBLE_DEVICES on Ascend and the network
    interface collectives use. Across nodes (train.nnodes > 1): --launcher slurm submits one batch
    job for every node (--dry-run prints its script), else run it on every node with the same
    recipe (shared storage for the work dir); see docs/MULTINODE.md.
    """
    _stage_command("train", recipe, set_, workdir, dry_run, json_out, launcher)


def run(
    recipe_arg: Annotated[Path | None, typer.Argument(
        metavar="RECIPE", help=f"Recipe YAML, the same as -r (default {common.DEFAULT_RECIPE_PATH}).")] = None,
    recipe: Annotated[Path | None, option("recipe")] = None,
    set_: common.SetOpt = None,
    workdir: common.WorkdirOpt = None,
    stages: Annotated[str | None, typer.Option("--stages", help="Comma list, e.g. prepare,hidden-states,train.")] = None,
    start: Annotated[str | None, typer.Option("--from", help="Rerun from this stage on (it and everything after).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rerun every selected stage.")] = False,
    replay: Annotated[Path | None, typer.Option("--replay", help="Rerun a past run from its manifest.json "
                                                "(its recipe and stages; --workdir for a fresh copy).")] = None,
    dry_run: common.DryRunOpt = False,
    json_out: common.JsonOpt = False,
    launcher: common.LauncherOpt = common.Launcher.local,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Stream every stage's output (the trainer's "
                                          "records, servers' start-up) instead of one line per stage.")] = False,
) -> None:
    """Run the pipeline: regen -> prepare -> hidden-states -> train -> eval -> serve -> bench -> report.

    Each stage is one line (live on a terminal: progress, rate, ETA; plain lines in a pipe) and
    its one-line result; its full output goes to DIR/logs/ (stage-<stage>.log, train.log,
    <role>-server.log), and a failed stage shows the last lines of the logs it wrote. Finished
    stages are fingerprinted in DIR/state.json: a rerun skips unchanged stages, reruns changed
    ones and everything downstream, and resumes an interrupted stage. --dry-run prints each
    selected stage's command (what `<stage> --dry-run` prints) in order and runs nothing.
    """
    recipe_path = common.one_path(recipe_arg, recipe, "recipe", "-r") or common.DEFAULT_RECIPE_PATH
    chosen = stages.split(",") if stages else None
    if launcher == "slurm":
        if replay is not None:
            common.fail("--replay with --launcher slurm: replay the run here, or submit its recipe with -r")
        from dspark_kit.cli.slurm import launch

        launch("run", recipe_path, set_, workdir, dry_run, json_out, chosen, start, force)
        return
    if replay is not None:
        r, recorded = _replayed(replay)
        chosen, wd = chosen or recorded, Path(workdir or replay).resolve()
    else:
        r = common.load(recipe_path, set_)
        wd = r.workdir_path(workdir)
    res = common.resolve(r, wd, planning=dry_run)  # the run's one Resolved: every stage asks it
    if dry_run:
        _pipeline_dry_run(res, wd, chosen, start, json_out)
        return
    # the command that resumes: the same recipe, values and stages (--from and --force are not
    # repeated: they would run again what this run finished)
    again = ["--replay", str(replay)] if replay is not None else [str(recipe_path), *(
        w for s in (set_ or []) for w in ("--set", s)), *(["--stages", stages] if stages else [])]
    rows = _pipeline(res, chosen, start, force, verbose, [*again, "-w", str(wd)])
    if json_out:
        common.emit_json({"workdir": str(wd), "stages": rows})
    else:
        _show_rows(wd, rows)


def _replayed(manifest: Path):
    """A past run's recipe and stages (its manifest.json); each way the recipe differs today, one line."""
    from dspark_kit.stages.pipeline import replay_recipe

    try:
        r, recorded, diffs = replay_recipe(manifest)
    except ValueError as e:
        common.fail(str(e))
    for d in diffs:
        common.console.print(f"[yellow]replay differs:[/] {d}", highlight=False)
    return r, recorded


def _pipeline_dry_run(res, wd: Path, chosen: list[str] | None, start: str | None, json_out: bool) -> None:
    from dspark_kit.recipe import RecipeError
    from dspark_kit.stages.pipeline import pipeline_dry_run, pipeline_plans

    try:
        plans = pipeline_plans(res, chosen, start)
        lines = pipeline_dry_run(res, plans=plans)
    except (RecipeError, ValueError, RuntimeError) as e:
        common.fail(str(e))
    if json_out:  # the plans each stage's run executes (and records in DIR/plans/)
        common.emit_json({"workdir": str(wd), "dry_run": lines, "plans": [p.as_dict() for p in plans]})
    else:
        typer.echo("\n".join(lines))


def _pipeline(res, chosen: list[str] | None, start: str | None, force: bool, verbose: bool,
              again: list[str]) -> list[dict]:
    """The selected stages, one line each; Ctrl-C names the command that resumes (`run` + `again`)."""
    from dspark_kit.processes import SignalStopped
    from dspark_kit.progress import StageDisplay
    from dspark_kit.stages.pipeline import run_pipeline

    try:
        with StageDisplay(verbose=verbose) as display:
            return run_pipeline(res, chosen, start, force, display)
    except (ValueError, OSError, RuntimeError) as e:
        common.fail(str(e), 1)
    except (KeyboardInterrupt, SignalStopped) as e:  # Ctrl-C, or scancel / timeout (SIGTERM): resumable alike
        import shlex

        how, code = (f"stopped by {e.signal_name}", e.code) if isinstance(e, SignalStopped) else ("interrupted", 130)
        common.fail(f"{how}: `{shlex.join(['dspark-kit', 'run', *again])}` resumes (finished stages are "
                    "skipped; the interrupted one picks up where it stopped, training from its last whole epoch)",
                    code)
    raise AssertionError("unreachable")


def _show_rows(wd: Path, rows: list[dict]) -> None:
    from dspark_kit.stages.pipeline import highlights

    table = Table(title=f"dspark-kit run — {wd}")
    for col in ("stage", "status", "seconds", "figure"):
        table.add_column(col)
    for row in rows:
        fig = row["figure"]
        table.add_row(row["stage"], row["status"], f"{row['seconds']:.1f}",
                      f"{fig:.3f}" if isinstance(fig, float) else str(fig))
    common.console.print(table)
    for line in highlights(wd):
        common.console.print(line, highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command()(prepare)
    app.command("hidden-states")(hidden_states)
    app.command()(train)
    app.command()(run)
