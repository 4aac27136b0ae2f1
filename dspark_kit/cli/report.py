"""`dspark-kit report`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_kit.cli.common import (
    DEFAULT_RECIPE_PATH,
    JsonOpt,
    RecipeOpt,
    SetOpt,
    WorkdirOpt,
    emit_json,
    fail,
    load,
)
from dspark_kit.cli.vocabulary import option


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        run_dir: Annotated[Path | None, typer.Argument(
            help="Run directory, the same as -w (default: the recipe's workdir).")] = None,
        recipe: RecipeOpt = DEFAULT_RECIPE_PATH,
        set_: SetOpt = None,
        workdir: WorkdirOpt = None,
        out: Annotated[Path | None, option(
            "out", help="Markdown file to write (default RUN_DIR/report/report.md; PNGs stay in RUN_DIR/report).")] = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Summarise a run as markdown + PNGs: training, eval and bench tables.

        Reads tensorboard events under RUN_DIR/logs and checkpoints/*/val_metrics.json
        (per-epoch validation table, loss and accept_len curves), eval/*.json and
        bench/*.json. Stages that have not run are listed as "not run". Prints the path.
        """
        from dspark_kit.stages.reporting.report import build_report

        if run_dir is not None and workdir is not None and run_dir.resolve() != workdir.resolve():
            fail(f"run directory given twice: {run_dir} and -w {workdir}; pass one (positionally or with -w)")
        run_dir = run_dir or workdir
        if run_dir is None:
            run_dir = load(recipe, set_).workdir_path()
        try:
            path = build_report(run_dir, out)
        except FileNotFoundError as e:
            fail(str(e))
        if json_out:
            emit_json({"report": str(path)})
        else:
            typer.echo(str(path))
