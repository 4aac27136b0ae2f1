"""`dspark-kit bench` and `dspark-kit bench --compare`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_kit.cli import common
from dspark_kit.cli.vocabulary import option
from dspark_kit.rundir import bench_result_file


def bench(
    files: Annotated[list[Path] | None, typer.Argument(
        help="With --compare: bench JSON files (ours or `vllm bench serve --save-result`).")] = None,
    recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH,
    set_: common.SetOpt = None,
    workdir: common.WorkdirOpt = None,
    base_url: Annotated[str | None, option(
        "endpoint", help="Running server, e.g. http://127.0.0.1:8000 (default: recipe serve.host:port).")] = None,
    num_prompts: Annotated[int | None, option("num_prompts", min=1, help="Default: bench.num_prompts.")] = None,
    concurrency: Annotated[int | None, option("concurrency", min=1, help="Requests in flight (default: bench.concurrency).")] = None,
    max_tokens: Annotated[int | None, option("max_new_tokens", min=1, help="Per request (default: bench.max_tokens).")] = None,
    dataset: Annotated[str, option(
        "prompts", help="'builtin' (eval's default prompts, in eval's order: the builtin data's held-out set, else "
        "speculators' validation split of DIR/prepared; the tiny corpus's held-out set when there is no "
        "DIR/prepared) "
        "or a chat .jsonl (e.g. regen output); first user turn is sent.")] = "builtin",
    categories: Annotated[str | None, option(
        "categories", help="Also benchmark these prompt sets one after another, acceptance per category from "
        "/metrics deltas (default: bench.categories).")] = None,
    temperature: common.TemperatureOpt = None,
    label: Annotated[str | None, typer.Option("--label", help=f"Names the result: {bench_result_file('', '<label>')} (default: recipe name).")] = None,
    out: Annotated[Path | None, option(
        "out", help="Output dir (default DIR/bench, DIR = -w or the recipe's workdir); with --compare a .md file or a dir.")] = None,
    compare: Annotated[bool, typer.Option(
        "--compare", help="Compare result files instead of benchmarking: prints a markdown table; --out also writes it + a per-position PNG.")] = False,
    dry_run: common.DryRunOpt = False,
    json_out: common.JsonOpt = False,
) -> None:
    """Benchmark a running chat server: throughput, TTFT/TPOT/ITL and spec-decode acceptance.

    Acceptance comes from /metrics counter deltas (vllm:spec_decode_*), scraped
    before and after: acceptance length = 1 + accepted / drafts. Start the server
    first (`dspark-kit serve`), then e.g.:

      dspark-kit bench -r recipes/tiny-cpu.yaml --label ckpt1

      dspark-kit bench --compare runs/x/bench/bench_ckpt0.json runs/x/bench/bench_ckpt1.json --out cmp.md

    --dry-run prints the bench stage's plan as this command runs it: the server it measures (it
    starts none), the prompts, how many and how many in flight, the temperature, the categories
    and the result file; it sends no request.
    """
    from dspark_kit.engines.prom import MetricsError
    from dspark_kit.stages.serving.bench import BenchError, bench_endpoint, endpoint_plan

    if compare:
        _compare(files, out, dry_run, json_out)
        return
    if files:
        common.fail(f"unexpected arguments {[str(f) for f in files]}: result files need --compare")
    res = common.resolve(common.load(recipe, common.with_temperature(set_, temperature)), workdir, planning=True)  # the model name and K to record: nothing to build or train
    out_dir = out or res.run.bench
    if dry_run:
        chosen = common.prompt_categories(res, categories, "bench")
        try:
            common.show_plan(endpoint_plan(res, base_url, label, out_dir, num_prompts, concurrency, max_tokens,
                                           dataset, chosen), json_out)
        except (BenchError, ValueError, OSError) as e:
            common.fail(str(e))
        return
    try:
        result = bench_endpoint(res, base_url, label, out_dir, num_prompts=num_prompts, concurrency=concurrency,
                           max_tokens=max_tokens, dataset=dataset, categories=categories)
    except (BenchError, MetricsError) as e:
        common.fail(str(e))
    if json_out:
        common.emit_json(result)
        return
    from dspark_kit.measure.bench_tables import bench_markdown
    from dspark_kit.rundir import bench_result_file

    typer.echo(bench_markdown([result]))
    typer.echo(f"wrote {bench_result_file(out_dir, result['label'])}", err=True)


def _compare(files: list[Path] | None, out: Path | None, dry_run: bool, json_out: bool) -> None:
    from dspark_kit.engines.prom import MetricsError
    from dspark_kit.measure.bench_tables import compare as compare_results

    if not files:
        common.fail("--compare: pass one or more bench JSON files, e.g. --compare A.json B.json")
    if dry_run:
        common.fail("--dry-run: not with --compare (it starts nothing and writes only --out)")
    try:
        md, written = compare_results(files, out)
    except MetricsError as e:
        common.fail(str(e))
    if json_out:
        common.emit_json({"markdown": md, "written": [str(p) for p in written]})
        return
    typer.echo(md)
    for p in written:
        typer.echo(f"wrote {p}", err=True)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
