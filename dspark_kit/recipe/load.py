"""Reading a recipe: the YAML file, `--set` overrides and one-line errors.

Every way a file can be wrong (missing, a directory, not UTF-8, not YAML, a
key given twice, an unknown key, a bad value) is one `RecipeError` line that
names the file, the key and the fix.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from dspark_kit.recipe.schema import Recipe, RecipeError, is_named_source

# A recipe is a path, or the name of one shipped with the package (`tiny-cpu`): the default is a
# name, so `dspark-kit run` works from any folder, inside the checkout or not.
DEFAULT_RECIPE = "tiny-cpu"
RECIPE_SUFFIX = ".yaml"


def shipped_recipes_dir() -> Path:
    """The recipes shipped with the package: dspark_kit/recipes/ in an installed wheel (setup.py
    copies the checkout's recipes/ there), the checkout's recipes/ in a source tree."""
    package = Path(__file__).resolve().parents[1]
    inside = package / "recipes"
    return inside if inside.is_dir() else package.parent / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """name -> file of every shipped recipe (`tiny-cpu` -> .../recipes/tiny-cpu.yaml)."""
    folder = shipped_recipes_dir()
    return {p.stem: p for p in sorted(folder.glob(f"*{RECIPE_SUFFIX}"))} if folder.is_dir() else {}


def recipe_about(path: Path) -> str:
    """What a recipe file says it is for: its first comment line ("" when it opens with none)."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            return ""
        if line.strip("# ").strip():
            return line.strip("# ").strip()
    return ""


def recipe_path(given: str | Path | None) -> Path:
    """A recipe as typed: a file that exists (relative: from the shell's folder), else a shipped
    recipe's name (`-r tiny-cpu`); anything else stays as given (read_recipe_data names the fix)."""
    path = Path(given or DEFAULT_RECIPE)
    if path.exists():
        return path
    name = str(given or DEFAULT_RECIPE)
    return shipped_recipes().get(name.removesuffix(RECIPE_SUFFIX), path) if "/" not in name else path


def shown_key(part: object) -> str:
    """A key as an error shows it: control characters escaped, so the error stays one line."""
    text = str(part)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _sections() -> dict[str, type[BaseModel] | None]:
    """Recipe's top-level keys: a section's model, or None for a plain value."""
    out = {}
    for name, f in Recipe.model_fields.items():
        ann = f.annotation
        out[name] = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return out


def known_keys() -> list[str]:
    """Every recipe key, dotted (section.key, or a top-level key)."""
    keys = []
    for name, model in _sections().items():
        keys += [f"{name}.{k}" for k in model.model_fields] if model is not None else [name]
    return keys


def did_you_mean(key: str) -> str:
    """' (did you mean X?)' for the closest known key, else ''."""
    close = difflib.get_close_matches(key, known_keys(), n=1, cutoff=0.6)
    if not close and "." in key:  # the key alone, in any section
        last = key.rsplit(".", 1)[1]
        close = [k for k in known_keys() if k.rsplit(".", 1)[-1] == last][:1] or difflib.get_close_matches(
            last, [k.rsplit(".", 1)[-1] for k in known_keys()], n=1, cutoff=0.75)
        close = [k for k in known_keys() if k.endswith("." + close[0]) or k == close[0]][:1] if close else []
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_override(path: list[str]) -> str | None:
    """The part of a --set key the recipe does not have, or None (a key inside a mapping-valued key,
    as train.loss.ce, is the mapping's business)."""
    sections = _sections()
    if path[0] not in sections:
        return path[0]
    model = sections[path[0]]
    if model is None or len(path) == 1:
        return None
    return None if path[1] in model.model_fields else ".".join(path[:2])


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(shown_key(p) for p in e["loc"])
        msg = " ".join(str(e["msg"]).split()).removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = (f"unknown key{did_you_mean(loc)} (check spelling; `dspark-kit recipe reference` lists "
                   "every key)")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected section.name=value, e.g. --set train.epochs=3")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise RecipeError(f"--set {item!r}: empty key")
    try:
        return path, yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise RecipeError(f"--set {item!r}: value is not valid YAML; quote it, e.g. --set '{key}=\"...\"'") from None


# Path keys, and what a relative value means. Inputs the recipe points at are read from the recipe
# file's folder, so a recipe means the same from any shell directory; the run's outputs (workdir,
# storage_path) are made where you run, as `-w` is. `~` is the home directory in all of them.
INPUT_PATHS = (("verifier", "path"), ("data", "source"), ("serve", "checkpoint"), ("train", "init_from"),
               ("hidden_states", "reuse_from"))
OUTPUT_PATHS = (("workdir",), ("hidden_states", "storage_path"))


def _is_input_path(key: tuple[str, ...], value: str, base: Path) -> bool:
    """Whether an input key's value is a local path rather than a name (builtin:, a data preset, a
    hub id org/name, a checkpoint keyword or epoch number)."""
    if value.startswith("builtin:"):
        return False
    if value.startswith(("/", "~", "./", "../")) or value in (".", ".."):
        return True
    if key == ("data", "source"):  # a preset[:SPLIT] or hf: name, unless such a file is there
        return not is_named_source(value) or (base / value).exists()
    if key == ("serve", "checkpoint"):
        return "/" in value  # a bare name is a folder under the run's checkpoints/
    if key in (("train", "init_from"), ("hidden_states", "reuse_from")):
        return True  # always a folder
    return (base / value).exists()  # verifier.path: a folder beside the recipe, else a hub id


def resolve_path(key: tuple[str, ...], value: Any, base: Path) -> Any:
    """A path key's value with `~` expanded and, for an input, a relative path made absolute from
    `base` (the recipe file's folder; the current directory for a `--set`)."""
    if not isinstance(value, str) or not value.strip():
        return value  # validation names a wrong type
    if key in OUTPUT_PATHS:
        return str(Path(value).expanduser()) if value.startswith("~") else value
    if key in INPUT_PATHS and _is_input_path(key, value, base):
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else (base / path).resolve())
    return value


def resolve_paths(data: dict, base: Path) -> dict:
    """The file's path keys resolved against its folder `base` (see resolve_path)."""
    for key in (*INPUT_PATHS, *OUTPUT_PATHS):
        node = data
        for part in key[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and key[-1] in node:
            node[key[-1]] = resolve_path(key, node[key[-1]], base)
    return data


def apply_overrides(data: dict, overrides: list[str], base: Path | None = None) -> dict:
    """`--set` items applied to a recipe's mapping; with `base` (the shell's directory, for values typed
    at a shell) path keys are resolved as the file's are against its folder."""
    for item in overrides:
        path, value = parse_override(item)
        bad = unknown_override(path)
        if bad is not None:
            raise RecipeError(f"--set {shown_key(item)}: {shown_key(bad)} is not a recipe key{did_you_mean(bad)}; "
                              "`dspark-kit recipe reference` lists every key")
        if base is not None:
            value = resolve_path(tuple(path), value, base)
        node = data
        for p in path[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise RecipeError(f"--set {item!r}: {p} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def recipe_from_dict(data: dict, source: str = "<dict>") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(f"{source}: {_format_error(e)}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base constructor reports unhashable keys itself
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {shown_key(key)!r} (first at line {seen[key]}; "
                                    "YAML would silently keep the last)", key_node.start_mark)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


# what a run cannot do without: `recipe validate` requires these to be written out in the file
RUN_KEYS = (("data", "source"), ("verifier", "path"))


def read_recipe_data(path: Path) -> dict:
    """The recipe file's mapping; every way a file can be unreadable is one RecipeError line."""
    if not path.exists():
        names = ", ".join(shipped_recipes()) or "none"
        raise RecipeError(f"recipe {path}: file not found; pass -r PATH or a shipped recipe's name ({names}; "
                          "`dspark-kit recipe list`)")
    if path.is_dir():
        raise RecipeError(f"recipe {path}: is a directory; pass a recipe file, e.g. recipes/tiny-cpu.yaml")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise RecipeError(f"recipe {path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise RecipeError(f"recipe {path}: not UTF-8 text (byte {e.start}, line {line}); "
                          "save the file as UTF-8") from None
    if not text.strip() or all(not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()):
        raise RecipeError(f"recipe {path}: the file is empty; start from an example in recipes/")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"recipe {path}: not valid YAML{where} ({problem})") from None
    if data is None:
        raise RecipeError(f"recipe {path}: the file is empty; start from an example in recipes/")
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: top level must be a mapping of sections")
    return data


def check_run_keys(data: dict, source: str) -> None:
    """A recipe a run can use names its data and verifier itself (defaults are for code and tests)."""
    missing = []
    for section, key in RUN_KEYS:
        node = data.get(section)
        if not isinstance(node, dict) or node.get(key) in (None, ""):
            missing.append(f"{section}.{key}")
    if missing:
        raise RecipeError(f"recipe {source}: {', '.join(missing)} not set; a run needs them written "
                          "in the recipe (e.g. data.source: builtin:tiny-chat, verifier.path: builtin:tiny-qwen3)")


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None,
                require_run_keys: bool = False) -> Recipe:
    """Load a recipe file (+ --set overrides). require_run_keys: also demand RUN_KEYS (recipe validate)."""
    path = recipe_path(path)
    data = resolve_paths(read_recipe_data(path), path.parent.resolve())
    data = apply_overrides(data, overrides or [], base=Path.cwd())
    if require_run_keys:
        check_run_keys(data, str(path))
    return recipe_from_dict(data, str(path))


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(json.loads(recipe.model_dump_json()), sort_keys=False)
