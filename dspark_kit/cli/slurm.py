"""`--launcher slurm` for `run` and the stage commands that span nodes: parse, call the launcher, print."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from dspark_kit.cli import common


def launch(command: str, recipe_path: Path, sets: list[str] | None, workdir: Path | None, dry_run: bool,
           json_out: bool, stages: list[str] | None = None, start: str | None = None, force: bool = False) -> None:
    """Write the job's batch script; --dry-run prints it as submitted, else sbatch it and follow the job
    (exit code: the job's; Ctrl-C cancels it)."""
    from dspark_kit.launchers.slurm_job import SlurmError, launch_job, make_job
    from dspark_kit.launchers.slurm_script import batch_script
    from dspark_kit.recipe import RecipeError

    r = common.load(recipe_path, sets)
    wd = r.workdir_path(workdir)
    try:
        job = make_job(r, recipe_path, wd, sets, command, stages, start, force)
        script = batch_script(job)
    except (RecipeError, ValueError) as e:
        common.fail(str(e))
    if dry_run:
        if json_out:
            common.emit_json({"workdir": str(wd), "stages": list(job.stages), "script": script})
        else:
            typer.echo(script, nl=False)
        return
    if not job.stages:
        common.console.print(f"nothing to submit: every selected stage is done in {wd} ({'; '.join(job.skipped)}); "
                             "--force reruns them", highlight=False, soft_wrap=True)
        return
    again = shlex.join(["dspark-kit", command, "-r", str(recipe_path), *(w for s in sets or [] for w in ("--set", s)),
                        "-w", str(wd), "--launcher", "slurm"])
    try:
        code, line = launch_job(job, lambda text: common.console.print(text, highlight=False, soft_wrap=True,
                                                                         markup=False), again)
    except SlurmError as e:
        common.fail(str(e), 1)
    if line:
        common.fail(line, code)
    if command == "run" and not json_out:
        from dspark_kit.stages.pipeline import highlights

        for text in highlights(wd):
            common.console.print(text, highlight=False, soft_wrap=True, markup=False)
