"""Issue 14: every way a recipe file can be wrong is one error line (exit 2), never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import Recipe, RecipeError, load_recipe

ROOT = Path(__file__).resolve().parent.parent
GOOD = (ROOT / "recipes/tiny-cpu.yaml").read_text()


def _plant(tmp_path: Path, kind: str) -> Path:
    f = tmp_path / "recipe.yaml"
    if kind == "latin1":
        f.write_bytes(GOOD.replace("name: tiny-cpu", "name: caf\xe9").encode("latin-1"))
    elif kind == "directory":
        f.mkdir()
    elif kind == "duplicate":
        f.write_text(GOOD.replace("train:\n", "train:\n  epochs: 7\n", 1))  # epochs twice in train
    elif kind == "duplicate-section":
        f.write_text(GOOD + "\ndata:\n  limit: 3\n")
    elif kind == "empty":
        f.write_text("")
    elif kind == "comments-only":
        f.write_text("# nothing here\n\n")
    return f


KINDS = ["latin1", "directory", "duplicate", "duplicate-section", "empty", "comments-only"]
EXPECT = {"latin1": "not UTF-8", "directory": "is a directory", "duplicate": "duplicate key 'epochs'",
          "duplicate-section": "duplicate key 'data'", "empty": "empty", "comments-only": "empty"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", [["recipe", "validate"], ["train", "--dry-run", "-r"],
                                     ["regen", "--dry-run", "-r"]])
def test_bad_recipe_file_is_one_error_line(tmp_path, kind, command):
    f = _plant(tmp_path, kind)
    r = CliRunner().invoke(app, [*command, str(f)])
    out = r.output
    assert r.exit_code == 2, out
    assert "Traceback" not in out and r.exception is None or isinstance(r.exception, SystemExit), out
    assert EXPECT[kind] in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("drop", ["  source: builtin:tiny-chat\n", "  path: builtin:tiny-qwen3\n"])
def test_validate_requires_data_source_and_verifier_path(tmp_path, drop):
    f = tmp_path / "r.yaml"
    f.write_text(GOOD.replace(drop, "", 1))
    r = CliRunner().invoke(app, ["recipe", "validate", str(f)])
    assert r.exit_code == 2 and ("data.source" if "source" in drop else "verifier.path") in r.output
    load_recipe(f)  # code that loads it for a stage still gets the defaults


def test_shipped_recipes_validate_and_defaults_stay_usable():
    r = CliRunner().invoke(app, ["recipe", "validate", *map(str, sorted((ROOT / "recipes").glob("*.yaml")))])
    assert r.exit_code == 0, r.output
    assert Recipe().data.source  # Recipe() defaults remain usable in code
    with pytest.raises(RecipeError, match="duplicate"):
        load_recipe(_plant_dup(ROOT))


def _plant_dup(root: Path) -> Path:
    import tempfile

    f = Path(tempfile.mkdtemp()) / "dup.yaml"
    f.write_text("name: a\nname: b\n")
    return f
