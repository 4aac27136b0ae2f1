"""A recipe is a path or a shipped recipe's name: `-r tiny-cpu` runs from any folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import DEFAULT_RECIPE, RecipeError, load_recipe, recipe_path, shipped_recipes

REPO = Path(__file__).resolve().parents[1]


def test_a_name_is_the_shipped_recipe_and_a_path_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the checkout: recipes/ is not here
    shipped = shipped_recipes()
    assert {p.name for p in (REPO / "recipes").glob("*.yaml")} == {p.name for p in shipped.values()}
    assert recipe_path("tiny-cpu") == recipe_path("tiny-cpu.yaml") == shipped["tiny-cpu"]
    assert recipe_path(None) == shipped[DEFAULT_RECIPE]
    assert load_recipe("tiny-cpu").name == "tiny-cpu"
    mine = tmp_path / "tiny-cpu"  # a file that exists wins over the name
    mine.write_text((REPO / "recipes" / "tiny-cpu.yaml").read_text().replace("name: tiny-cpu", "name: mine"))
    assert load_recipe("tiny-cpu").name == "mine"
    assert recipe_path("recipes/tiny-cpu.yaml") == Path("recipes/tiny-cpu.yaml")  # a path is never a name
    with pytest.raises(RecipeError, match="shipped recipe's name .*tiny-cpu"):
        load_recipe("no-such-recipe")


def test_recipe_list_shows_every_shipped_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(app, ["recipe", "list"])
    assert out.exit_code == 0, out.output
    for name in shipped_recipes():
        assert any(line.startswith(name + " ") for line in out.output.splitlines()), name
