"""Options and error handling shared by every command."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from dspark_kit.cli.vocabulary import option
from dspark_kit.recipe import DEFAULT_RECIPE, Recipe, RecipeError, load_recipe

console = Console(stderr=True)

# the shared options, named by the one table (cli/vocabulary.py)
RecipeOpt = Annotated[Path, option("recipe", show_default=True)]
SetOpt = Annotated[list[str] | None, option("set")]
WorkdirOpt = Annotated[Path | None, option("workdir")]
DryRunOpt = Annotated[bool, option("dry_run")]
JsonOpt = Annotated[bool, option("json")]


class Launcher(str, Enum):
    """--launcher: where a command runs (here, or as a Slurm batch job)."""

    local = "local"
    slurm = "slurm"


LauncherOpt = Annotated[Launcher, option("launcher")]
TemperatureOpt = Annotated[float | None, typer.Option(
    "--temperature", min=0.0, max=100.0,
    help="Measure at this sampling temperature (lossless speculative sampling; 0 = greedy). Sets "
         "eval.temperature, the one eval, tune and bench share.")]


def with_temperature(sets: list[str] | None, temperature: float | None) -> list[str] | None:
    """--temperature as the recipe override it is (eval.temperature: one source of truth)."""
    return sets if temperature is None else [*(sets or []), f"eval.temperature={temperature}"]

DEFAULT_RECIPE_PATH = Path(DEFAULT_RECIPE)


def fail(message: str, code: int = 2) -> None:
    # soft_wrap: one line even when stderr is a pipe (Rich would wrap at 80 columns)
    from rich.markup import escape

    from dspark_kit.redact import redact_text

    # escape: a message's own brackets ("[pitfall 9]", a list) are text, not Rich markup
    console.print(f"[bold red]error:[/] {escape(redact_text(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def resolve(recipe: Recipe, workdir: Path | None = None, **choices):
    """The command's one Resolved (its flags as `choices`: engine, checkpoint, window, planning),
    built at the command's entry and passed down; a bad flag is one line."""
    from dspark_kit.resolved import Resolved, ResolveError

    try:
        return Resolved(recipe, workdir, **choices)
    except ResolveError as e:
        fail(str(e))


def one_path(positional: Path | None, option: Path | None, what: str, flag: str) -> Path | None:
    """`CMD X` and `CMD FLAG X` name the same thing (`run RECIPE` / `-r`, `report RUN_DIR` / `-w`);
    two different paths is an error."""
    if positional is not None and option is not None and positional.resolve() != option.resolve():
        fail(f"{what} given twice: {positional} and {flag} {option}; pass one (positionally or with {flag})")
    return positional or option


def load(recipe: Path, sets: list[str] | None, require_run_keys: bool = False) -> Recipe:
    try:
        return load_recipe(recipe, sets or [], require_run_keys=require_run_keys)
    except RecipeError as e:
        fail(str(e))
        raise  # unreachable


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def stage_plan(name: str, res):
    """The stage's plan (stages/steps.py REGISTRY): what a run of it executes; one that cannot be
    made is one line."""
    from dspark_kit.stages.steps import REGISTRY

    try:
        return REGISTRY[name].plan(res)
    except (RecipeError, ValueError, RuntimeError) as e:
        fail(str(e))


def show_plan(plan, json_out: bool) -> None:
    """What --dry-run prints: the plan's lines (commands and `# ` notes), or with --json the plan as data."""
    if json_out:
        emit_json(plan.as_dict())
    else:
        typer.echo("\n".join(plan.lines))


def prompt_categories(res, given: str | None, section: str) -> list[str]:
    """--categories, else `<section>.categories` (stages.prompts.chosen_categories): a
    misspelt name fails before anything loads."""
    from dspark_kit.measure.eval_prompts import EvalError
    from dspark_kit.stages.prompts import chosen_categories

    try:
        return chosen_categories(res, given, section)
    except EvalError as e:
        fail(str(e))
        raise  # unreachable
