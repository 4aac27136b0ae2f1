"""`dspark-kit window plan|tune`: draft KV window arithmetic and window tuning."""

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
    console,
    emit_json,
    fail,
    load,
)
from dspark_kit.cli.eval import parse_int_list

window_app = typer.Typer(
    help="Draft KV window (vLLM-Ascend draft_window_size): plan the arithmetic, tune the size.",
    no_args_is_help=True,
)


@window_app.command("plan")
def plan_cmd(
    seq_lens: Annotated[str, typer.Option("--seq-lens", help="Comma-separated draft sequence lengths, e.g. 10,60,200,64.")],
    window: Annotated[int, typer.Option("--window", "-W", min=1, help="draft_window_size W.")],
    block_size: Annotated[int, typer.Option("--block-size", "-b", min=1, help="KV cache (kernel) block size b.")] = 128,
    future_offset: Annotated[int, typer.Option(
        "--future-offset", "-K", min=0, help="0 for dspark/dflash, num_speculative_tokens for eagle3.")] = 0,
    json_out: JsonOpt = False,
) -> None:
    """Show what the draft attends to: start = ((seq + K - W) clamped at 0 // b) * b.

    windowed = seq - start, start_block = start // b, needed blocks =
    ceil(windowed / b) capped at ceil(W / b) + 1. KV writes are never windowed.

      dspark-kit window plan --seq-lens 10,60,200,64 --window 64 --block-size 16 --future-offset 3
    """
    from dspark_kit.window import plan_window

    lens = parse_int_list(seq_lens, "--seq-lens") or fail("--seq-lens: give at least one length, e.g. --seq-lens 10,60")
    try:
        plan = plan_window(lens, window, block_size, future_offset)
    except ValueError as e:
        fail(str(e))
    if json_out:
        emit_json(plan.as_dict())
        return
    typer.echo(f"W={window} b={block_size} K={future_offset} max_window_blocks={plan.max_window_blocks}")
    typer.echo("seq_len  windowed_len  start_block  needed_blocks")
    for row in zip(plan.seq_lens, plan.windowed_lens, plan.start_blocks, plan.needed_blocks, strict=True):
        typer.echo("{:>7}  {:>12}  {:>11}  {:>13}".format(*row))
    typer.echo("windowed lengths: " + ",".join(map(str, plan.windowed_lens)))


@window_app.command("tune")
def tune_cmd(
    recipe: RecipeOpt = DEFAULT_RECIPE_PATH,
    set_: SetOpt = None,
    workdir: WorkdirOpt = None,
    checkpoint: Annotated[str | None, typer.Option("--checkpoint", help="Default: serve.checkpoint.")] = None,
    windows: Annotated[str | None, typer.Option(
        "--windows", help="Candidate windows (default: training window x1, x2, x4... below the longest context).")] = None,
    context_lengths: Annotated[str | None, typer.Option(
        "--context-lengths", help="Default: eval.context_lengths, else 2x, 4x and 8x the training window.")] = None,
    allow_below: Annotated[bool, typer.Option(
        "--allow-below", help="Allow windows below the draft's training window (REFERENCE pitfall 9).")] = False,
    num_prompts: Annotated[int | None, typer.Option("--num-prompts", min=1)] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", min=1)] = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="jsonl of chats or text lines.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Sweep draft windows across context lengths and recommend one.

    Picks the window with the best long-context acceptance that keeps
    short-context acceptance; writes <workdir>/eval/window_tune.json whose
    `recommended_window` serve.draft_window_size: auto uses (null = leave the
    window unset: acceptance is flat).
    """
    from dspark_kit.checkpoints import CheckpointError
    from dspark_kit.draft_model import DraftLoadError
    from dspark_kit.evaluate import EvalError, tune_window

    r = load(recipe, set_)
    try:
        result = tune_window(
            r, r.workdir_path(workdir), checkpoint, candidates=parse_int_list(windows, "--windows"),
            context_lengths=parse_int_list(context_lengths, "--context-lengths"), allow_below=allow_below,
            num_prompts=num_prompts, max_new_tokens=max_new_tokens, prompts_file=prompts,
            log=lambda m: console.print(m, highlight=False),
        )
    except (EvalError, CheckpointError, DraftLoadError) as e:
        fail(str(e))
    if json_out:
        emit_json(result)
        return
    ctx = ["0", *map(str, result["context_lengths"])]
    typer.echo("window  " + "  ".join(f"{'short' if c == '0' else c:>7}" for c in ctx))
    for key, row in result["acceptance_length"].items():
        typer.echo(f"{key:>6}  " + "  ".join(f"{row[c] if row[c] is not None else '-':>7}" for c in ctx))
    typer.echo(f"recommended_window: {result['recommended_window']} -> {result['file']}")


def register(app: typer.Typer) -> None:
    app.add_typer(window_app, name="window")
