"""`prepare`, `hidden-states`, `train` and `run`: thin wrappers over dspark_kit.stages.pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

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
    one_recipe,
    resolve,
)
from dspark_kit.cli.vocabulary import option


def _dry_run(name: str, res, json_out: bool) -> None:
    """The stage's plan: its lines, or (--json) the plan as data; what a run of it executes."""
    from dspark_kit.recipe import RecipeError
    from dspark_kit.stages.steps import REGISTRY

    try:
        plan = REGISTRY[name].plan(res)
    except (RecipeError, ValueError, RuntimeError) as e:
        fail(str(e))
    if json_out:
        emit_json(plan.as_dict())
    else:
        typer.echo("\n".join(plan.lines))


def _run_one(name: str, res, json_out: bool) -> None:
    from dspark_kit.stages.manifest import update_manifest
    from dspark_kit.stages.pipeline import stage_result
    from dspark_kit.stages.steps import REGISTRY, execute

    try:
        summary = execute(REGISTRY[name], res)
    except (ValueError, OSError, RuntimeError) as e:
        message = str(e)  # the stage is named once, whether or not the error already names it
        fail(message if message.startswith(f"{name}:") else f"{name}: {message}", 1)
    update_manifest(res.run.root, res.recipe, name, resolved=res, summary=summary)
    if json_out:
        emit_json(summary)
    else:  # the stage's one-line result, as `run` prints it; --json has every figure
        typer.echo(f"{name}: {stage_result(REGISTRY[name], summary)}")


def register(app: typer.Typer) -> None:
    @app.command()
    def prepare(recipe: RecipeOpt = DEFAULT_RECIPE_PATH, set_: SetOpt = None, workdir: WorkdirOpt = None,
                dry_run: DryRunOpt = False, json_out: JsonOpt = False) -> None:
        """Tokenize chats with the verifier's chat template; write DIR/prepared (speculators Arrow + token_freq.pt).

        Input: DIR/regen.jsonl when it exists, else the recipe's data.source. Loss mask = assistant
        tokens only; thinking mode: the one regen recorded per row, else verifier.thinking (a mixture's
        draw for the row).
        """
        res = resolve(load(recipe, set_), workdir, planning=dry_run)
        if dry_run:
            _dry_run("prepare", res, json_out)
            return
        _run_one("prepare", res, json_out)

    @app.command("hidden-states")
    def hidden_states(recipe: RecipeOpt = DEFAULT_RECIPE_PATH, set_: SetOpt = None, workdir: WorkdirOpt = None,
                      dry_run: DryRunOpt = False, json_out: JsonOpt = False) -> None:
        """Verifier hidden states for every prepared row -> DIR/prepared/hidden_states/hs_{i}.safetensors.

        Resumable: valid files are skipped, corrupt ones regenerated. Layer ids: the recipe's
        target_layer_ids plus the last layer N (vLLM convention, pre-norm). backend vllm: the
        recipe's engine serves extraction and speculators generate-offline-data writes the files
        (--dry-run prints the server and one command per node).
        """
        res = resolve(load(recipe, set_), workdir, planning=dry_run)
        if dry_run:
            _dry_run("hidden-states", res, json_out)
            return
        _run_one("hidden-states", res, json_out)

    @app.command()
    def train(recipe: RecipeOpt = DEFAULT_RECIPE_PATH, set_: SetOpt = None, workdir: WorkdirOpt = None,
              dry_run: DryRunOpt = False, json_out: JsonOpt = False) -> None:
        """Train the DSpark draft with the real speculators trainer -> DIR/checkpoints.

        --dry-run prints the exact command (torchrun when train.nproc > 1 or nnodes > 1; one line
        per node), including device env such as ASCEND_RT_VISIBLE_DEVICES on Ascend and the network
        interface collectives use. Across nodes (train.nnodes > 1) run it on every node with the same
        recipe (shared storage for the work dir); see docs/MULTINODE.md.
        """
        res = resolve(load(recipe, set_), workdir, planning=dry_run)
        if dry_run:
            _dry_run("train", res, json_out)
            return
        _run_one("train", res, json_out)

    @app.command()
    def run(
        recipe_arg: Annotated[Path | None, typer.Argument(
            metavar="RECIPE", help=f"Recipe YAML, the same as -r (default {DEFAULT_RECIPE_PATH}).")] = None,
        recipe: Annotated[Path | None, option("recipe")] = None,
        set_: SetOpt = None,
        workdir: WorkdirOpt = None,
        stages: Annotated[str | None, typer.Option("--stages", help="Comma list, e.g. prepare,hidden-states,train.")] = None,
        start: Annotated[str | None, typer.Option("--from", help="Rerun from this stage on (it and everything after).")] = None,
        force: Annotated[bool, typer.Option("--force", help="Rerun every selected stage.")] = False,
        replay: Annotated[Path | None, typer.Option("--replay", help="Rerun a past run from its manifest.json "
                                                    "(its recipe and stages; --workdir for a fresh copy).")] = None,
        dry_run: DryRunOpt = False,
        json_out: JsonOpt = False,
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
        from dspark_kit.stages.pipeline import run_pipeline

        recipe_path = one_recipe(recipe_arg, recipe)
        chosen = stages.split(",") if stages else None
        if replay is not None:
            from dspark_kit.stages.pipeline import replay_recipe

            try:
                r, recorded, diffs = replay_recipe(replay)
            except ValueError as e:
                fail(str(e))
            chosen = chosen or recorded
            wd = Path(workdir or replay).resolve()
            for d in diffs:
                console.print(f"[yellow]replay differs:[/] {d}", highlight=False)
        else:
            r = load(recipe_path, set_)
            wd = r.workdir_path(workdir)
        res = resolve(r, wd, planning=dry_run)  # the run's one Resolved: every stage asks it
        if dry_run:
            from dspark_kit.recipe import RecipeError
            from dspark_kit.stages.pipeline import pipeline_dry_run, pipeline_plans

            try:
                plans = pipeline_plans(res, chosen, start)
                lines = pipeline_dry_run(res, plans=plans)
            except (RecipeError, ValueError, RuntimeError) as e:
                fail(str(e))
            if json_out:  # the plans each stage's run executes (and records in DIR/plans/)
                emit_json({"workdir": str(wd), "dry_run": lines, "plans": [p.as_dict() for p in plans]})
            else:
                typer.echo("\n".join(lines))
            return
        from dspark_kit.progress import StageDisplay

        try:
            with StageDisplay(verbose=verbose) as display:
                rows = run_pipeline(res, chosen, start, force, display)
        except (ValueError, OSError, RuntimeError) as e:
            fail(str(e), 1)
        except KeyboardInterrupt:
            import shlex

            words = ["--replay", str(replay)] if replay is not None else [str(recipe_path), *(
                w for s in (set_ or []) for w in ("--set", s))]
            again = shlex.join(["dspark-kit", "run", *words, "-w", str(wd)])
            fail(f"interrupted: `{again}` resumes (finished stages are skipped; the interrupted one picks up "
                 "where it stopped, training from its last whole epoch)", 130)
        if json_out:
            emit_json({"workdir": str(wd), "stages": rows})
            return
        table = Table(title=f"dspark-kit run — {wd}")
        for col in ("stage", "status", "seconds", "figure"):
            table.add_column(col)
        for row in rows:
            fig = row["figure"]
            table.add_row(row["stage"], row["status"], f"{row['seconds']:.1f}",
                          f"{fig:.3f}" if isinstance(fig, float) else str(fig))
        console.print(table)
        from dspark_kit.stages.pipeline import highlights

        for line in highlights(wd):
            console.print(line, highlight=False, soft_wrap=True)
