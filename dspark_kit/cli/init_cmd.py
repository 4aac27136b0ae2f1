"""`dspark-kit init`: a recipe for your own verifier."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_kit.cli import common
from dspark_kit.cli.vocabulary import option


def init(
    verifier: Annotated[str, typer.Option("--verifier", help="Verifier: a Hugging Face model dir or hub id "
                                          "(config.json, tokenizer and chat template are read; never the weights).")],
    output: Annotated[Path, option("out", help="Recipe file to write, e.g. recipes/my-verifier.yaml.")],
    data: Annotated[str | None, option("data", help="Chat data (jsonl/json/parquet file, save_to_disk folder, "
                                       "hf:NAME[:CONFIG]:SPLIT, ultrachat, gsm8k...; docs/DATA.md): data.source, and data.seq_length from its token lengths.")] = None,
    target_device: Annotated[str, option("target_device")] = "auto",
    nodes: Annotated[int, typer.Option("--nodes", help="Training nodes (> 1 writes the multi-node keys).")] = 1,
    num_devices: Annotated[int | None, typer.Option(
        "--num-devices", help="Accelerators per node, split between the serving engine and the trainer "
                              "(default: the ones visible here, else 4).")] = None,
    thinking: Annotated[bool | None, typer.Option(
        "--thinking/--no-thinking", help="Chat-template thinking mode (default: from the template).")] = None,
    mask_token_id: Annotated[int | None, typer.Option(
        "--mask-token-id", help="Reserved token id for the draft's MASK (default: the first spare embedding row).")] = None,
    master_addr: Annotated[str | None, typer.Option(
        "--master-addr", help="With --nodes > 1: node 0's address (default: this machine's).")] = None,
    overwrite: Annotated[bool, option("overwrite", help="Overwrite an existing recipe file at --out.")] = False,
    device_memory_gib: Annotated[float | None, typer.Option(
        "--device-memory-gib", help="Memory of one training device in GiB, for a machine that is not this one "
                                    "(default: this machine's device); training settings are chosen to fit it.")] = None,
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", help="Run the Python files the verifier folder's config.json auto_map names (as "
                                    "transformers and vLLM ask); without it such a folder is refused, nothing runs. "
                                    "Writes verifier.trust_remote_code: true.")] = False,
) -> None:
    """Write a complete recipe for your verifier; every derived value carries a comment saying where
    it came from (docs/CONCEPTS.md). Then: `dspark-kit preflight -r FILE` and `dspark-kit run FILE`."""
    from dspark_kit.stages.init.init_recipe import InitError, InitOptions, write_new_recipe

    opts = InitOptions(verifier=verifier, output=output, data=data, device=target_device, nodes=nodes,
                       num_devices=num_devices, thinking=thinking, mask_token_id=mask_token_id,
                       master_addr=master_addr, force=overwrite, device_memory_gib=device_memory_gib,
                       trust_remote_code=trust_remote_code)
    try:
        new = write_new_recipe(opts)
    except InitError as e:
        common.fail(str(e))
    width = max(len(k) for k, _, _ in new.derived)
    vwidth = max(len(v) for _, v, _ in new.derived)
    for key, value, source in new.derived:
        typer.echo(f"  {key:<{width}}  {value:<{vwidth}}  {source}")
    for line in new.memory:
        typer.echo(line)
    for warning in new.warnings:
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"wrote {new.path}\nnext: dspark-kit preflight -r {new.path} && dspark-kit run {new.path} --dry-run")


def register(app: typer.Typer) -> None:
    app.command("init")(init)
