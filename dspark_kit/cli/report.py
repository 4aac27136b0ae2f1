"""`dspark-kit report`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_kit.cli import common
from dspark_kit.cli.vocabulary import option


def report(
    run_dir: Annotated[Path | None, typer.Argument(
        help="Run directory, the same as -w (default: the recipe's workdir).")] = None,
    recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH,
    set_: common.SetOpt = None,
    workdir: common.WorkdirOpt = None,
    out: Annotated[Path | None, option(
        "out", help="Markdown file to write (default RUN_DIR/report/report.md; PNGs stay in RUN_DIR/report).")] = None,
    dry_run: common.DryRunOpt = False,
    json_out: common.JsonOpt = False,
) -> None:
    """Summarise a run as markdown + PNGs: training, eval and bench tables.

    Reads tensorboard events under RUN_DIR/logs and checkpoints/*/val_metrics.json
    (per-epoch validation table, loss and accept_len curves), eval/*.json and
    bench/*.json. Stages that have not run are listed as "not run". Prints the path.
    --dry-run prints the report stage's plan for this run directory: what it reads and the
    markdown file and PNG folder it would write; it writes nothing.
    """
    from dspark_kit.rundir import RunDir
    from dspark_kit.stages.reporting.report import build_report, report_plan

    run_dir = common.one_path(run_dir, workdir, "run directory", "-w")
    run_dir = run_dir or common.load(recipe, set_).workdir_path()  # the recipe only names the folder
    if dry_run:
        try:
            common.show_plan(report_plan(RunDir.at(run_dir), out), json_out)
        except (FileNotFoundError, ValueError) as e:
            common.fail(str(e))
        return
    try:
        path = build_report(run_dir, out)
    except FileNotFoundError as e:
        common.fail(str(e))
    if json_out:
        common.emit_json({"report": str(path)})
    else:
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.command("report")(report)
