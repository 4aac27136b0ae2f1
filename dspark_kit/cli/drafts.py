"""`dspark-kit import` / `export`: a DSpark draft in any published layout <-> the speculators layout."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_kit.cli import common


def _k_line(cfg: dict, layout: str) -> str:
    from dspark_kit.specdec.anchor import anchor_layout, word

    a = anchor_layout(cfg, layout)
    return (f"block {a.block_size}, sample_from_anchor {word(a.sample_from_anchor)}: {a.slots} draft tokens a block "
            f"(num_speculative_tokens <= {a.slots})")


def _anchor_flag(value: str | None) -> bool | None:
    if value is None:
        return None
    if value.lower() not in ("true", "false"):
        common.fail(f"--sample-from-anchor {value}: true or false")
    return value.lower() == "true"


def import_cmd(
    src: Annotated[Path, typer.Argument(help="A DSpark draft in a published layout (DeepSeek's, speculators' or "
                                             "SpecForge's): config.json and model.safetensors.")],
    dest: Annotated[Path, typer.Argument(help="A new folder: the draft in the speculators layout.")],
    verifier: Annotated[str, typer.Option("--verifier", help="The verifier the draft was trained for (its "
                                                               "path or hub id); a local path also lets import "
                                                               "measure an anchor layout the config leaves out.")],
    sample_from_anchor: Annotated[str | None, typer.Option(
        "--sample-from-anchor", help="true|false: the anchor layout the draft was trained in, over what "
                                     "import would measure.")] = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="jsonl of {\"messages\": [...]} rows to "
                                                                   "measure the anchor layout on (default: a "
                                                                   "few generic prompts).")] = None,
    json_out: common.JsonOpt = False,
) -> None:
    """Read a released DSpark draft into the layout the kit trains, evaluates and serves.

    The layout is recognized by its own markers and recorded, every key kept; a field the kit does
    not read is one line naming it. When the config does not say its anchor layout
    (sample_from_anchor; SpecForge's drafts never do), import decodes a few prompts with each
    layout on the verifier and keeps the one that accepts more, printing both figures.
    Tensors are copied byte for byte. Example:

      dspark-kit import ./dspark_qwen3_8b_block7 ./imported --verifier Qwen/Qwen3-8B
    """
    from dspark_kit.specdec.anchor_measure import read_chats
    from dspark_kit.specdec.draft_layouts import LayoutError, import_draft
    from dspark_kit.specdec.verifier import verifier_config

    forced = _anchor_flag(sample_from_anchor)
    try:
        chats = read_chats(prompts) if prompts is not None else None
    except ValueError as e:
        common.fail(str(e))
    vcfg = verifier_config(verifier) or {}
    measure = None
    if (Path(verifier).expanduser() / "config.json").is_file():
        from dspark_kit.specdec.anchor_measure import measure_layouts

        def measure(dirs):
            return measure_layouts(dirs, Path(verifier).expanduser(), chats)

    try:
        cfg, report = import_draft(src, dest, verifier, vcfg.get("architectures"), forced, measure)
    except LayoutError as e:
        common.fail(str(e))
    line, anchor = _k_line(cfg, "speculators"), report["anchor"]
    measured = anchor.get("acceptance")
    if json_out:
        common.emit_json({"ok": True, "checkpoint": str(dest.resolve()), "layout": report["layout"], "k": line,
                          "anchor": anchor, "notes": report["notes"]})
        return
    for note in report["notes"]:
        typer.echo(f"note: {note}", err=True)
    if measured:
        typer.echo(f"anchor layout measured on {verifier}: acceptance length {measured['true']:.3f} with "
                   f"sample_from_anchor true, {measured['false']:.3f} with false")
        if anchor["value"] != (measured["true"] >= measured["false"]):
            typer.echo(f"warning: sample_from_anchor {str(anchor['value']).lower()} was forced but accepts less; "
                       "preflight refuses it", err=True)
    typer.echo(f"{src} ({report['layout']} layout) -> {dest} (speculators layout): {line}; "
               f"sample_from_anchor from {anchor['source']}")


def export_cmd(
    src: Annotated[Path, typer.Argument(help="A checkpoint the kit trained or imported (an epoch folder).")],
    dest: Annotated[Path, typer.Argument(help="A new folder: the draft in the layout asked for.")],
    layout: Annotated[str, typer.Option("--layout", help="native (DeepSeek's, which vLLM reads), sglang "
                                                         "(SGLang's DSpark loader) or gguf (llama.cpp: "
                                                         "DEST/draft.gguf and DEST/verifier.gguf).")] = "native",
    verifier: Annotated[Path | None, typer.Option(
        "--verifier", help="gguf: the verifier's HF folder (its tokenizer and output head go into the draft "
                           "GGUF; converted to DEST/verifier.gguf unless --verifier-gguf). Default: the "
                           "folder the checkpoint records.")] = None,
    verifier_gguf: Annotated[Path | None, typer.Option(
        "--verifier-gguf", help="gguf: the verifier's own GGUF file (e.g. a quantized release), placed as "
                                "DEST/verifier.gguf instead of converting the HF folder.")] = None,
    outtype: Annotated[str, typer.Option("--outtype", help="gguf: the draft's tensor type (f32, f16, bf16, "
                                                           "q8_0); the verifier's when converted is f16.")] = "f16",
    json_out: common.JsonOpt = False,
) -> None:
    """Write a checkpoint the kit trained in DSpark's own layout (the one released drafts use), or SGLang's.

    Qwen3DSparkModel config, target_layer_ids = aux_hidden_state_layer_ids - 1, sample_from_anchor
    explicit (sglang: the DSpark keys also in dflash_config and dspark_config); `import` gives back
    the same config.json and tensors.

    --layout gguf runs llama.cpp's own converter (`make llama-cpp` unpacks it) with
    --target-model-dir, writes sample_from_anchor explicitly, refuses in one line a draft llama.cpp
    cannot serve (a layer config other than speculators' qwen3 or llama, a Markov head other than
    vanilla), and reads the GGUF back to
    check block size, mask token, target layers, sample_from_anchor, Markov rank and confidence
    head (docs/LLAMACPP.md). Examples:

      dspark-kit export runs/tiny-cpu/checkpoints/checkpoint_best ./exported --layout sglang
      dspark-kit export runs/smollm2/checkpoints/checkpoint_best ./gguf --layout gguf \
          --verifier ./smollm2-hf --verifier-gguf ./SmolLM2-135M-Instruct.Q4_1.gguf
    """
    if layout == "gguf":
        from dspark_kit.specdec.gguf_export import GgufExportError, export_gguf, recorded_verifier
        from dspark_kit.specdec.llamacpp_tree import LlamaCppMissing

        try:
            out = export_gguf(src, dest, verifier or recorded_verifier(src), verifier_gguf, outtype)
        except (GgufExportError, LlamaCppMissing) as e:
            common.fail(str(e))
        if json_out:
            common.emit_json({"ok": True, "layout": "gguf", **out})
        else:
            typer.echo(f"{src} -> {out['draft']} (gguf, {outtype}): block {out['block_size']}, mask token "
                       f"{out['mask_token_id']}, target layers {out['target_layers']}, sample_from_anchor "
                       f"{str(out['sample_from_anchor']).lower()}, Markov rank {out['markov_rank']}, confidence head "
                       f"{'yes' if out['confidence_head'] else 'no'} (read back from the GGUF)")
            typer.echo(f"verifier: {out['verifier']} <- {out['verifier_from']}")
        return
    from dspark_kit.specdec.draft_layouts import LayoutError, export_draft

    try:
        cfg = export_draft(src, dest, layout)
    except LayoutError as e:
        common.fail(str(e))
    line = _k_line(cfg, layout)
    if json_out:
        common.emit_json({"ok": True, "draft": str(dest.resolve()), "layout": layout, "k": line})
    else:
        typer.echo(f"{src} -> {dest} ({layout} layout): {line}")


def register(app: typer.Typer) -> None:
    app.command("import")(import_cmd)
    app.command("export")(export_cmd)
