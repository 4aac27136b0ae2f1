"""`dspark-kit eval --suite/--benchmarks/--compare`: parse, resolve, call stages.evaluation.suite_eval."""

from __future__ import annotations

import typer

from dspark_kit.cli import common


def _temperatures(value: str | None) -> tuple[float, ...]:
    if value is None:
        return (0.0, 1.0)
    try:
        temps = tuple(dict.fromkeys(float(x) for x in value.replace(" ", "").split(",") if x))
    except ValueError:
        common.fail(f"--temperatures {value!r}: expected comma-separated numbers, e.g. --temperatures 0,1")
    if not temps or any(t < 0 for t in temps):
        common.fail(f"--temperatures {value!r}: give at least one temperature >= 0")
    return temps


def suite_cmd(recipe, set_, workdir, checkpoint, window, eval_device, suite, benchmarks, limit, benchmark_file,
              temperatures, seed, bootstrap, compare, max_new_tokens, out, dry_run, json_out, endpoint=None,
              concurrency=None) -> None:
    from dspark_kit.data.benchmarks import BenchmarkError
    from dspark_kit.measure.eval_prompts import EvalError
    from dspark_kit.measure.suite_report import compare_markdown, suite_markdown
    from dspark_kit.specdec.checkpoints import CheckpointError
    from dspark_kit.specdec.draft_model import DraftLoadError
    from dspark_kit.stages.evaluation.suite_eval import (
        compare_checkpoints,
        run_suite,
        suite_options,
        suite_plan,
    )

    loaded = common.load(recipe, set_)
    if compare and endpoint:
        common.fail("--compare with --endpoint: a served run has no per-request records to pair; compare in-process")
    if compare and not (suite or benchmarks):
        common.fail("--compare A B: also name what to measure, --suite NAME or --benchmarks a,b")
    try:
        opts = suite_options(suite, benchmarks, limit or loaded.eval.num_prompts, _temperatures(temperatures), seed,
                             bootstrap, max_new_tokens or loaded.eval.max_new_tokens, loaded.eval.benchmark_files,
                             benchmark_file)
    except EvalError as e:
        common.fail(str(e))
    chosen = opts.suite

    def resolved(ckpt):
        return common.resolve(loaded, workdir, checkpoint=ckpt, window=window, eval_device=eval_device,
                              planning=dry_run)

    res = resolved(checkpoint)
    base = out or res.run.eval / f"suite-{chosen.name}"
    if dry_run:
        try:
            common.show_plan(suite_plan(res, opts, base, compare, endpoint), json_out)
        except (EvalError, CheckpointError) as e:
            common.fail(str(e))
        return
    log = (lambda m: typer.echo(m, err=True)) if json_out else (lambda m: common.console.print(m, highlight=False))
    try:
        if compare:
            result = compare_checkpoints(resolved, compare, opts, base, log)
            if json_out:
                common.emit_json(result)
            else:
                typer.echo(compare_markdown(result))
            return
        summary = run_suite(res, opts, base, log, endpoint, concurrency or loaded.bench.concurrency)
    except (EvalError, BenchmarkError, CheckpointError, DraftLoadError) as e:
        common.fail(str(e))
    if json_out:
        common.emit_json({k: v for k, v in summary.items() if k != "requests"})
        return
    typer.echo(suite_markdown(summary))
    typer.echo(f"files in {base}")
