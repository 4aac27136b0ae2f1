"""prepare as the stage runs it, on the tokenizer fixture (a byte-level BPE with the tiny verifier's
chat template: no model is loaded), for the data tests."""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER = Path(__file__).resolve().parent / "fixtures" / "tiny_tokenizer"


def chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def run_prepare(tmp_path: Path, source: Path | str, capsys=None, **data) -> tuple[dict, list[dict], str]:
    """prepare as the stage runs it (regen off: data.source as is): (summary, errors file entries, console)."""
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.steps import run_stage

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml")
    recipe.verifier.path = str(TOKENIZER)
    recipe.regen.enabled = False
    recipe.data.source, recipe.data.limit, recipe.data.seq_length = str(source), None, data.pop("seq_length", 128)
    for k, v in data.items():
        setattr(recipe.data, k, v)
    res = Resolved(recipe, tmp_path / "run")
    summary = run_stage("prepare", res)
    errors = res.run.prepared.with_name("prepared.errors.jsonl")
    entries = [json.loads(line) for line in errors.read_text().splitlines()]
    return summary, entries, capsys.readouterr().err if capsys else ""


def prepared_texts(tmp_path: Path) -> list[tuple[str, str]]:
    """(whole row, trained tokens) of each prepared row, decoded."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    ds = load_from_disk(str(tmp_path / "run" / "prepared"))
    return [(tok.decode(ids), tok.decode([i for i, m in zip(ids, mask) if m]))
            for ids, mask in zip(ds["input_ids"], ds["loss_mask"])]


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path
