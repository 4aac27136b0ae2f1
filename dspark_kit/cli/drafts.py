"""`dspark-kit import` / `export`: a DSpark draft in its own layout <-> the speculators layout."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_kit.cli import common


def _k_line(cfg: dict, layout: str) -> str:
    from dspark_kit.specdec.draft_layouts import slots

    anchor = cfg.get("sample_from_anchor", layout == "native")
    block = cfg.get("block_size", cfg.get("dspark_block_size"))
    return (f"block {block}, sample_from_anchor {str(anchor).lower()}: {slots(cfg, layout)} draft tokens a block "
            f"(num_speculative_tokens <= {slots(cfg, layout)})")

def _convert(convert, src: Path, dest: Path, layout: str, key: str, json_out: bool) -> None:
    """One layout conversion (`convert()` returns the written config): its K line, or its error as one line."""
    from dspark_kit.specdec.draft_layouts import LayoutError

    try:
        cfg = convert()
    except LayoutError as e:
        common.fail(str(e))
    line = _k_line(cfg, layout)
    if json_out:
        common.emit_json({"ok": True, key: str(dest.resolve()), "k": line})
    else:
        typer.echo(f"{src} -> {dest} ({'DSpark' if layout == 'native' else layout} layout): {line}")


def import_cmd(
    src: Annotated[Path, typer.Argument(help="A DSpark draft in its own layout (config.json with "
                                             "architectures Qwen3DSparkModel, model.safetensors).")],
    dest: Annotated[Path, typer.Argument(help="A new folder: the draft in the speculators layout.")],
    verifier: Annotated[str, typer.Option("--verifier", help="The verifier the draft was trained for (its "
                                                               "path or hub id); recorded as the kit records "
                                                               "it for a checkpoint it trained.")],
    json_out: common.JsonOpt = False,
) -> None:
    """Read a released DSpark draft (deepseek-ai/dspark_qwen3_*) into the layout the kit trains,
    evaluates and serves.

    sample_from_anchor is written as the draft was trained (the DSpark layout's default, true,
    when its config leaves it out: vLLM's speculators loader would read a missing key as false).
    Tensors are copied byte for byte. Example:

      dspark-kit import ./dspark_qwen3_8b_block7 ./imported --verifier Qwen/Qwen3-8B
    """
    from dspark_kit.specdec.draft_layouts import import_draft
    from dspark_kit.specdec.verifier import verifier_config

    vcfg = verifier_config(verifier) or {}
    _convert(lambda: import_draft(src, dest, verifier, vcfg.get("architectures")), src, dest, "speculators",
             "checkpoint", json_out)


def export_cmd(
    src: Annotated[Path, typer.Argument(help="A checkpoint the kit trained (an epoch folder).")],
    dest: Annotated[Path, typer.Argument(help="A new folder: the draft in DSpark's own layout.")],
    json_out: common.JsonOpt = False,
) -> None:
    """Write a checkpoint the kit trained in DSpark's own layout, the one released drafts use.

    Qwen3DSparkModel config, target_layer_ids = aux_hidden_state_layer_ids - 1, sample_from_anchor
    explicit; `import` gives back the same config.json and tensors. Example:

      dspark-kit export runs/tiny-cpu/checkpoints/checkpoint_best ./exported
    """
    from dspark_kit.specdec.draft_layouts import export_draft

    _convert(lambda: export_draft(src, dest), src, dest, "native", "draft", json_out)


def register(app: typer.Typer) -> None:
    app.command("import")(import_cmd)
    app.command("export")(export_cmd)
