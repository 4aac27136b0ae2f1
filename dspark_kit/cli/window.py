"""`dspark-kit window plan|tune`: draft KV window arithmetic and window tuning."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_kit.cli import common
from dspark_kit.cli.eval import parse_int_list
from dspark_kit.cli.vocabulary import option
from dspark_kit.specdec.window import ASCEND_KV_BLOCK_SIZE

window_app = typer.Typer(
    help="Draft KV window (vLLM-Ascend draft_window_size): plan the arithmetic, tune the size.",
    no_args_is_help=True,
)


@window_app.command("plan")
def plan_cmd(
    context_lens: Annotated[str, option(
        "context_lengths", help="Comma-separated context lengths (tokens already in the draft's KV cache).")],
    window: Annotated[int, option("draft_window_size", min=1, help="draft_window_size W.")],
    kv_block_size: Annotated[int, typer.Option(
        "--kv-block-size", min=1, help="KV-cache (kernel) block size b (default: vllm-ascend's); not the draft's block_size.")] = ASCEND_KV_BLOCK_SIZE,
    num_speculative_tokens: Annotated[int, typer.Option(
        "--num-speculative-tokens", min=0, help="K, the drafted tokens per step.")] = 0,
    method: Annotated[str, typer.Option(
        "--method", help="dspark | dflash (seq = context + K, future_offset 0) or eagle3 "
                         "(seq = context, future_offset K).")] = "dspark",
    json_out: common.JsonOpt = False,
) -> None:
    """Show what the draft attends to, as vllm-ascend computes it.

    seq = context + K for dspark/dflash (the query block [anchor, MASK x (K-1)] is
    counted), start = ((seq + future_offset - W) clamped at 0 // b) * b,
    windowed = seq - start, start_block = start // b, needed blocks =
    ceil(windowed / b) capped at ceil(W / b) + 1. KV writes are never windowed.

      dspark-kit window plan --context-lengths 10,60,200,64 -W 64 --kv-block-size 16 --num-speculative-tokens 3
    """
    from dspark_kit.specdec.window import draft_seq_len, future_offset, plan_window

    lens = parse_int_list(context_lens, "--context-lengths") or common.fail(
        "--context-lengths: give at least one length, e.g. --context-lengths 10,60")
    try:
        seqs = [draft_seq_len(method, n, num_speculative_tokens) for n in lens]
        offset = future_offset(method, num_speculative_tokens)
        plan = plan_window(seqs, window, kv_block_size, offset)
    except ValueError as e:
        common.fail(str(e))
    if json_out:
        common.emit_json({"method": method, "context_lens": lens, "num_speculative_tokens": num_speculative_tokens,
                   **plan.as_dict()})
        return
    typer.echo(f"method={method} W={window} b={kv_block_size} K={num_speculative_tokens} "
               f"future_offset={offset} max_window_blocks={plan.max_window_blocks}")
    typer.echo("context  seq_len  windowed_len  start_block  needed_blocks")
    for row in zip(lens, plan.seq_lens, plan.windowed_lens, plan.start_blocks, plan.needed_blocks, strict=True):
        typer.echo("{:>7}  {:>7}  {:>12}  {:>11}  {:>13}".format(*row))
    typer.echo("windowed lengths: " + ",".join(map(str, plan.windowed_lens)))


def tune_cmd(
    recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH,
    set_: common.SetOpt = None,
    workdir: common.WorkdirOpt = None,
    checkpoint: Annotated[str | None, option("checkpoint")] = None,
    ks: Annotated[str | None, typer.Option(
        "--ks", help="num_speculative_tokens to compare (default: the draft's block size and one less).")] = None,
    windows: Annotated[str | None, typer.Option(
        "--windows", help="Candidate windows (default: training window x1, x2, x4... below the longest context).")] = None,
    context_lengths: Annotated[str | None, option(
        "context_lengths", help="Default: eval.context_lengths, else 2x, 4x and 8x the training window.")] = None,
    allow_below: Annotated[bool, typer.Option(
        "--allow-below", help="Allow windows below the draft's training window (docs/PITFALLS.md, pitfall 9).")] = False,
    num_prompts: Annotated[int | None, option("num_prompts", min=1, help="Default: eval.num_prompts.")] = None,
    max_new_tokens: Annotated[int | None, option("max_new_tokens", min=1, help="Default: eval.max_new_tokens.")] = None,
    prompts: Annotated[Path | None, option(
        "prompts", help="jsonl of chats or text lines (default: prompts the draft never trained on, as eval).")] = None,
    served: Annotated[bool, typer.Option(
        "--served", help="Measure through the recipe's serving engine and recommend by output throughput "
                         "(DIR/eval/served_tune.json).")] = False,
    concurrency: Annotated[int | None, option(
        "concurrency", min=1, help="--served: requests in flight (default: bench.concurrency).")] = None,
    eval_device: Annotated[str | None, option(
        "eval_device", help="In-process: auto, cpu, cuda or npu (cuda:1 ...) for the verifier and draft "
                            "(default: where training runs).")] = None,
    temperature: common.TemperatureOpt = None,
    dry_run: common.DryRunOpt = False,
    json_out: common.JsonOpt = False,
) -> None:
    """Sweep K x draft window across context lengths and recommend both (at eval.temperature / --temperature).

    Per K, picks the window with the best long-context acceptance that keeps
    short-context acceptance; then the K with the best mean acceptance. Writes
    DIR/eval/window_tune.json: serve.num_speculative_tokens: auto uses its
    `recommended_k`, serve.draft_window_size: auto its `recommended_window`
    (null = no window: acceptance is flat). Also `dspark-kit window tune`.

    With --served: each (K, window) is served by the recipe's engine (vLLM on CUDA: K
    only, it has no runtime window), the verifier alone too, and the eval prompts (short
    and long-context) go to it at the bench concurrency; the recommendation is the
    highest output throughput (ties within the measured spread: the higher acceptance),
    shown beside the acceptance-only choice. A rerun resumes; --dry-run prints the plan.
    """
    from dspark_kit.measure.eval_prompts import EvalError
    from dspark_kit.specdec.checkpoints import CheckpointError
    from dspark_kit.specdec.draft_model import DraftLoadError
    from dspark_kit.stages.evaluation.window_tune import tune_window

    if served and eval_device:
        common.fail("--eval-device: the served tune measures where the recipe's engine serves (serve.*, train.device); "
             "drop --eval-device or the --served flag")
    # a served dry run plans (before training: the checkpoint path training will write); it starts nothing
    res = common.resolve(common.load(recipe, common.with_temperature(set_, temperature)), workdir, checkpoint=checkpoint,
                  eval_device=eval_device, planning=served and dry_run)
    if served:
        return served_tune_cmd(res, ks, windows, context_lengths, allow_below, num_prompts, max_new_tokens,
                               prompts, concurrency, dry_run, json_out)
    if dry_run:
        common.fail("--dry-run: only with --served (the in-process tune starts nothing)")
    try:
        result = tune_window(
            res, candidates=parse_int_list(windows, "--windows"),
            context_lengths=parse_int_list(context_lengths, "--context-lengths"), allow_below=allow_below,
            ks=parse_int_list(ks, "--ks"),
            num_prompts=num_prompts, max_new_tokens=max_new_tokens, prompts_file=prompts,
            log=lambda m: common.console.print(m, highlight=False),
        )
    except (EvalError, CheckpointError, DraftLoadError) as e:
        common.fail(str(e))
    if json_out:
        common.emit_json(result)
        return
    ctx = ["0", *map(str, result["context_lengths"])]
    typer.echo("K  window  " + "  ".join(f"{'short' if c == '0' else c:>7}" for c in ctx))
    for k, table in result["acceptance_length_by_k"].items():
        for key, row in table.items():
            typer.echo(f"{k:>1}  {key:>6}  " + "  ".join(f"{row[c] if row[c] is not None else '-':>7}" for c in ctx))
    typer.echo(f"recommended_k: {result['recommended_k']}  recommended_window: {result['recommended_window']} "
               f"-> {result['file']}")
    from dspark_kit.measure.threshold_curve import curve_markdown
    from dspark_kit.stages.evaluation.eval_outputs import budget_markdown

    for line in budget_markdown(result.get("verify_budget")) + curve_markdown(result.get("threshold_curve")):
        typer.echo(line)


def served_tune_cmd(res, ks, windows, context_lengths, allow_below, num_prompts, max_new_tokens, prompts,
                    concurrency, dry_run, json_out) -> None:
    from dspark_kit.resolved import ResolveError
    from dspark_kit.specdec.checkpoints import CheckpointError
    from dspark_kit.stages.evaluation.served_tune import EvalError, served_tune

    def say(m: str) -> None:
        common.console.print(m, highlight=False, soft_wrap=True)

    try:
        result = served_tune(res, ks=parse_int_list(ks, "--ks"), windows=parse_int_list(windows, "--windows"),
                             context_lengths=parse_int_list(context_lengths, "--context-lengths"),
                             allow_below=allow_below, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                             prompts_file=prompts, concurrency=concurrency, dry_run=dry_run, log=say)
    except (EvalError, CheckpointError, ResolveError, ValueError) as e:
        common.fail(str(e))
    if json_out:
        common.emit_json(result)
        return
    plan = result["plan"]
    if dry_run:
        typer.echo(f"tune --served on engine {plan['engine']}: {len(plan['servers'])} server starts "
                   f"({len(plan['to_run'])} to run), {plan['points']} points (contexts "
                   f"{', '.join(str(c or 'short') for c in plan['context_lengths'])}), concurrency "
                   f"{plan['concurrency']}; about {plan['estimated_s']} s ({plan['estimate']})")
        for label in plan["servers"]:
            typer.echo(f"  {'run ' if label in plan['to_run'] else 'done'}  {label}")
        for note in plan["notes"]:
            typer.echo(f"note: {note}")
        typer.echo(f"-> {plan['file']}")
        return
    from dspark_kit.stages.evaluation.served_sweep import markdown

    typer.echo(markdown(result))
    typer.echo(f"-> {result['file']}")


def register(app: typer.Typer) -> None:
    window_app.command("tune")(tune_cmd)
    app.command("tune")(tune_cmd)
    app.add_typer(window_app, name="window")
