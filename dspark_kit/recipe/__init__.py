"""The recipe: one typed YAML file that is the single source of truth.

schema.py holds the sections and what follows from the recipe alone; load.py
reads a file with `--set` overrides into a `Recipe`. Import from here.

Part of the core (layer 0): may import the other core modules only (atomic, ...); every other
folder imports the recipe, the recipe imports none of them.
"""

from dspark_kit.recipe.load import (
    DEFAULT_RECIPE,
    RUN_KEYS,
    apply_overrides,
    check_run_keys,
    dump_recipe,
    load_recipe,
    parse_override,
    read_recipe_data,
    recipe_about,
    recipe_from_dict,
    recipe_path,
    resolve_paths,
    shipped_recipes,
    shown_key,
)
from dspark_kit.recipe.schema import (
    DATA_PRESETS,
    DTYPE_BYTES,
    ENGINES,
    ROLES,
    TINY_VERIFIER,
    BenchCfg,
    DataCfg,
    DraftCfg,
    EvalCfg,
    HiddenStatesCfg,
    Recipe,
    RecipeError,
    RegenCfg,
    ServeCfg,
    TrainCfg,
    VerifierCfg,
    parse_window,
    reference_markdown,
)

__all__ = [
    "DATA_PRESETS",
    "DEFAULT_RECIPE",
    "DTYPE_BYTES",
    "ENGINES",
    "ROLES",
    "RUN_KEYS",
    "TINY_VERIFIER",
    "BenchCfg",
    "DataCfg",
    "DraftCfg",
    "EvalCfg",
    "HiddenStatesCfg",
    "Recipe",
    "RecipeError",
    "RegenCfg",
    "ServeCfg",
    "TrainCfg",
    "VerifierCfg",
    "apply_overrides",
    "check_run_keys",
    "dump_recipe",
    "load_recipe",
    "parse_override",
    "parse_window",
    "read_recipe_data",
    "recipe_about",
    "recipe_from_dict",
    "recipe_path",
    "reference_markdown",
    "resolve_paths",
    "shipped_recipes",
    "shown_key",
]
