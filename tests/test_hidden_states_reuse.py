"""hidden_states.reuse_from: an earlier run's files linked in for rows with the same token ids, the
rest computed; a run made another way is refused in one line; the key never reruns a finished stage."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_kit.cli import app

pytestmark = pytest.mark.slow  # prepare and hidden states on the tiny verifier

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"


def _run(wd: Path, *sets: str):
    argv = ["run", str(TINY), "-w", str(wd), "--stages", "prepare,hidden-states", "--set", "regen.enabled=false"]
    return CliRunner().invoke(app, [*argv, *(x for s in sets for x in ("--set", s))])


def _ids(wd: Path) -> list[list[int]]:
    from datasets import load_from_disk

    return [[int(t) for t in x] for x in load_from_disk(str(wd / "prepared"))["input_ids"]]


def _summary(wd: Path) -> dict:
    return json.loads((wd / "manifest.json").read_text())["stages"]["hidden-states"]["summary"]


def test_an_earlier_runs_files_are_linked_for_identical_rows_and_the_rest_computed(tmp_path, tiny_verifier):
    """A run on 12 chats, then one on those and 8 more (a fine-tune on grown data)."""
    from dspark_kit.data.tiny_corpus import conversations

    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(20, seed=3)))
    a, b = tmp_path / "a", tmp_path / "b"
    assert _run(a, f"data.source={src}", "data.limit=12").exit_code == 0
    assert _summary(a)["made_with"]["file_dtype"] == "bfloat16"  # what a later reuse checks against
    theirs = {tuple(x): i for i, x in enumerate(_ids(a))}
    # one of a's files no longer holds its row (as after a's prepare reran): it must not be linked
    hs = a / "prepared" / "hidden_states"
    (hs / "hs_1.safetensors").unlink()
    (hs / "hs_0.safetensors").rename(hs / "hs_1.safetensors")
    got = _run(b, f"data.source={src}", "data.limit=20", f"hidden_states.reuse_from={a}")
    assert got.exit_code == 0, got.output
    mine = _ids(b)
    shared = [(i, theirs[tuple(x)]) for i, x in enumerate(mine) if tuple(x) in theirs and theirs[tuple(x)] != 0]
    assert 0 < len(shared) < len(mine), "the larger run should share some rows and add others"
    s = _summary(b)
    assert s["rows_linked"] == len(shared) - 1 and s["rows_not_linked_unfit"] == 1  # a's misplaced hs_1
    assert s["generated"] == len(mine) - s["rows_linked"] and s["skipped"] == s["rows_linked"]
    for i, j in shared:
        mine_f, theirs_f = b / "prepared" / "hidden_states" / f"hs_{i}.safetensors", hs / f"hs_{j}.safetensors"
        assert os.path.samefile(mine_f, theirs_f) == (j != 1), (i, j)
    # the key says how the files came, not what they are: dropping it reruns nothing
    again = _run(b, f"data.source={src}", "data.limit=20")
    assert again.exit_code == 0 and "hidden-states: skipped (unchanged)" in again.output, again.output

    # files made another way are refused in one line naming the key that differs
    c = _run(tmp_path / "c", f"data.source={src}", "data.limit=20", f"hidden_states.reuse_from={a}",
             "hidden_states.dtype=float32")
    said = " ".join(c.output.split())
    assert c.exit_code != 0 and "hidden_states.dtype bfloat16, this run's is float32" in said, c.output
    assert not list((tmp_path / "c" / "prepared" / "hidden_states").glob("*.safetensors"))
    from dspark_kit.stages.hidden.reuse import HiddenStateMaker, ReuseError, link_reused

    other = HiddenStateMaker(**{**_summary(a)["made_with"], "layer_ids": (1, 2)})
    with pytest.raises(ReuseError, match=r"made with layers .* \[1, 2, 3, 4\], this run's is \[1, 2\]") as e:
        link_reused(b / "prepared", a, other)
    assert "\n" not in str(e.value)


def test_reuse_needs_offline_files():
    from dspark_kit.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="hidden_states.reuse_from: only with hidden_states.mode offline"):
        load_recipe(TINY, ["hidden_states.reuse_from=/tmp/x", "hidden_states.mode=online"])
