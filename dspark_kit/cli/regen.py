"""`dspark-kit regen`: regenerate a chat dataset's replies with the verifier."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_kit.cli import common
from dspark_kit.cli.vocabulary import option
from dspark_kit.progress import progress_bar


def regen(
    recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH,
    set_: common.SetOpt = None,
    workdir: common.WorkdirOpt = None,
    outfile: Annotated[Path | None, option("out", help="Output jsonl, one row per conversation (default DIR/regen.jsonl, where prepare reads it).")] = None,
    dataset: Annotated[str | None, option("data", help="Override data.source: builtin:tiny-chat, builtin:tiny-tools, a preset (ultrachat, gsm8k, ...), hf:NAME[:CONFIG]:SPLIT, a jsonl/json/parquet file or a save_to_disk folder (docs/DATA.md).")] = None,
    endpoint: Annotated[list[str] | None, option("endpoint", help="OpenAI base URL, e.g. http://10.0.0.5:8000/v1 (repeat for several servers; none = start a local engine).")] = None,
    model: Annotated[str | None, typer.Option(help="Model id to request (default: first id from GET /v1/models).")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Read at most N source rows.")] = None,
    concurrency: Annotated[int | None, option("concurrency", min=1, help="In-flight requests per endpoint (default regen.concurrency).")] = None,
    max_tokens: Annotated[int | None, option("max_new_tokens", min=1, help="Max new tokens per reply (default regen.max_tokens).")] = None,
    temperature: Annotated[float | None, typer.Option(min=0.0, help="Sampling temperature for every row (0 = greedy). Default: regen.temperature (a mixture draws one per row).")] = None,
    top_p: Annotated[float | None, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass.")] = None,
    seed: Annotated[int | None, typer.Option(help="Base seed (per request: seed + 1000*idx + turn; each row's draw from a mixture too).")] = None,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Skip rows already in the output (and repair a cut last line); --no-resume starts over (needs --overwrite when the output holds rows).")] = True,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="With --no-resume: empty an existing output and its errors file.")] = False,
    dry_run: common.DryRunOpt = False,
    json_out: common.JsonOpt = False,
    launcher: common.LauncherOpt = common.Launcher.local,
) -> None:
    """Stage 0: regenerate every assistant turn with the verifier (same model and thinking mode that training and serving use, docs/PITFALLS.md).

    User turns are kept, original replies dropped, each reply regenerated in order with the new replies as history. Rows are shared over all --endpoint servers (scale with more servers, not more concurrency); a server that keeps refusing connections is dropped and its rows go to the others. Failed rows (after retries with backoff) are listed in OUT.errors.jsonl; re-running with --resume retries exactly those.

    Reasoning (a server's reasoning_content/reasoning, or inline <think>) is stored per reply as reasoning_content. A server that refuses connections is waited for up to regen.unavailable_timeout seconds; every source row is reported as written, failed, not attempted or unusable.

    --launcher slurm: one batch job, a chat server on every node of the recipe's allocation and regen
    on the first over all of them (docs/MULTINODE.md).

    Example: dspark-kit regen -r recipes/tiny-cpu.yaml --limit 20 -w runs/tiny
    """
    from dspark_kit.data.sources import SourceError
    from dspark_kit.stages.dataset import regen as stage
    from dspark_kit.stages.pipeline import record_standalone

    if launcher == common.Launcher.slurm:
        given = [flag for flag, v in (("-o", outfile), ("--data", dataset), ("--endpoint", endpoint), ("--model", model),
                                      ("--limit", limit), ("--concurrency", concurrency), ("--max-new-tokens", max_tokens),
                                      ("--temperature", temperature), ("--top-p", top_p), ("--seed", seed)) if v]
        if given or not resume or overwrite:
            common.fail(f"--launcher slurm runs the recipe's regen into DIR/regen.jsonl: set {', '.join(given) or '--no-resume'} "
                        "as a recipe key instead (e.g. --set regen.concurrency=32, --set data.limit=100)")
        from dspark_kit.cli.slurm import launch

        launch("regen", recipe, set_, workdir, dry_run, json_out)
        return
    res = common.resolve(common.load(recipe, set_), workdir, planning=dry_run)
    # where requests go; with no endpoint, the engine command regen starts
    plan = stage.command_plan(res, endpoint, outfile)
    if dry_run:
        common.show_plan(plan, json_out)
        return
    options = {"limit": limit, "dataset": dataset, "model": model, "concurrency": concurrency,
               "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
    try:
        with progress_bar("regen", stage.rows_to_regen(res, limit, outfile or res.run.regen_jsonl, resume), unit="row", enabled=not json_out) as bar:
            summary = stage.run_command(res, plan, outfile=outfile, endpoints=endpoint, on_row=stage.RowProgress(bar),
                                        resume=resume, overwrite=overwrite, **options)
    except (SourceError, stage.OutputExists) as e:
        common.fail(str(e))
    except RuntimeError as e:  # e.g. the local engine did not start
        common.fail(str(e).splitlines()[0] + " (full log tail below)\n" + str(e), code=1)
    if json_out:
        common.emit_json(summary)
    else:
        _show(summary)
    if summary["all_endpoints_dead"]:
        raise typer.Exit(1)
    if summary["verdict"]:
        common.fail(summary["verdict"], code=1)
    if stage.as_the_stage(res, outfile, resume, options):  # a later `run` skips it, as it skips its own regen
        record_standalone(res, "regen", summary, summary["command_seconds"])


def _show(summary: dict) -> None:
    """The summary's lines on stderr: rows, each endpoint, failures and why, unusable rows."""
    from dspark_kit.stages.dataset.regen import mode_line, tools_line, truncated_line

    def say(line: str) -> None:
        common.console.print(line, highlight=False)

    say(f"regen: {summary['written']} rows written, {summary['failed']} failed, "
        f"{summary['not_attempted']} not attempted, "
        f"{summary['already_done']} already done -> {summary['outfile']} "
        f"({summary['rows_per_min']} rows/min, {summary['tokens_per_s']} tok/s)")
    for ep in summary["endpoints"]:
        state = f"DEAD: {ep['dead']}" if ep["dead"] else ("ok" if not ep["errors"] else "up")
        say(f"  {ep['url']}: {ep['rows']} rows, {ep['errors']} errors, {state}")
    if summary["failed"]:
        say(f"  failures: {summary['errors_file']} (re-run with --resume to retry them)")
        for reason, n in summary["failed_reasons"].items():
            say(f"    {n}: {reason}")
    if summary["not_attempted"]:
        say(f"  {summary['not_attempted']} rows not attempted (no live endpoint): --resume does them")
    if summary["skipped_rows"]:
        say(f"  source rows not sent: {summary['skipped_rows']}")
    for reason, n in summary["changed_rows"].items():
        say(f"  changed {n}: {reason}")
    for line in (tools_line(summary), mode_line(summary), truncated_line(summary)):
        if line:
            say(f"  {line}")
    for reason, n in summary["tool_chains_cut"].items():
        say(f"  {n} rows end early: {reason}")


def register(app: typer.Typer) -> None:
    app.command()(regen)
