"""`dspark-kit recipe show|validate`."""

from __future__ import annotations

from typing import Annotated

import typer

from dspark_kit.cli import common
from dspark_kit.recipe import dump_recipe

recipe_app = typer.Typer(help="Inspect and validate recipes.", no_args_is_help=True)


def show(recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH, set_: common.SetOpt = None,
         workdir: common.WorkdirOpt = None, json_out: common.JsonOpt = False) -> None:
    """Print the fully resolved recipe (defaults + overrides) and the derived values with
    where each came from (the run folder's checkpoint and tune result count)."""
    r = common.load(recipe, set_)
    res = common.resolve(r, workdir, planning=True)  # builds and trains nothing
    from dspark_kit.resolved.derived import derived_values

    derived = derived_values(res)
    if json_out:
        common.emit_json({"recipe": r.model_dump(mode="json"), "derived": derived})
        return
    typer.echo(dump_recipe(r))
    typer.echo("# derived")
    for k, v in derived.items():
        typer.echo(f"# {k}: {v}")


def list_cmd(json_out: common.JsonOpt = False) -> None:
    """List the recipes shipped with the package: `-r NAME` (or `run NAME`) runs one from any folder.

    Each line: the name, its file and what the recipe says it is for (its first comment line).
    """
    from dspark_kit.recipe import recipe_about, shipped_recipes

    rows = [{"name": name, "path": str(path), "about": recipe_about(path)} for name, path in shipped_recipes().items()]
    if json_out:
        common.emit_json(rows)
        return
    for row in rows:
        typer.echo(f"{row['name']:<32} {row['about']}  ({row['path']})")


def validate(recipes: Annotated[list[str], typer.Argument(help="Recipe files.")]) -> None:
    """Validate recipe files; exit 2 with a field-named error on the first bad one.

    Beyond the schema, a recipe must be a UTF-8 file with no key given twice, and must set
    what a run needs itself: data.source and verifier.path.
    """
    from pathlib import Path

    for p in recipes:
        common.load(Path(p), None, require_run_keys=True)
        typer.echo(f"ok  {p}")


def reference() -> None:
    """Print every recipe key with its default and help (markdown; docs/RECIPES.md)."""
    from dspark_kit.recipe import reference_markdown

    typer.echo(reference_markdown(), nl=False)


def register(app: typer.Typer) -> None:
    recipe_app.command("list")(list_cmd)
    recipe_app.command("show")(show)
    recipe_app.command("validate")(validate)
    recipe_app.command("reference")(reference)
    app.add_typer(recipe_app, name="recipe")
