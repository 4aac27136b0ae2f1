"""One owner per rule: a literal that spells a rule appears only in the module that owns it.

Each rule below is decided by one function or constant in the lowest layer that knows it; every
other module asks the owner. A second spelling is how two answers drift apart (a glob of
`bench_*.json` in one place and `*.json` in another), so this test reads every module's string and
number literals (docstrings and comments are prose and may name a rule) and fails on a literal of a
rule outside its owner. Like tests/test_layers.py, it reads the source: nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dspark_kit"


def module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(p for p in parts if p != "__init__")


# rule -> (what spells it, the owner module). Strings are matched on their text, f-strings with
# `{}` for each substitution (f"bench_{label}.json" reads "bench_{}.json").
STRING_RULES: dict[str, tuple[re.Pattern, str]] = {
    "a bench result's file name (rundir.bench_result_file, bench_result_files)":
        (re.compile(r"^bench_$|\bbench_[\w<>{}*-]*\.json\b|\bbench_\*"), "rundir"),
    "the best checkpoint's name (rundir.BEST_CHECKPOINT)": (re.compile(r"checkpoint_best"), "rundir"),
    "the epoch folders (rundir.epoch_dirs)": (re.compile(r"\[0-9\]"), "rundir"),  # rundir: .name.isdigit()
    "regen's failed rows beside its output (rundir.regen_errors_file)": (re.compile(r"\.errors\.jsonl"), "rundir"),
    "the API-key variable (engines.API_KEY_ENV)": (re.compile(r"DSPARK_KIT_API_KEY"), "engines"),
}

# number -> (the rule, its owner, {other module: the other thing the same number means there})
NUMBER_RULES: dict[int, tuple[str, str, dict[str, str]]] = {
    128: ("vllm-ascend's KV block (specdec.window.ASCEND_KV_BLOCK_SIZE)", "specdec.window", {
        "resolved.memory_plan": "a head dimension", "data.tiny_builder": "the tiny verifier's hidden size",
        "processes": "the shell's exit code for a signal (128 + signum)",
        "data.families": "gpt-oss's sliding window"}),
    8000: ("the chat/spec server's default port (recipe.schema.DEFAULT_SERVE_PORT)", "recipe.schema", {}),
    9736: ("the hidden-state server's default port (recipe.schema.DEFAULT_HIDDEN_STATES_PORT)", "recipe.schema", {}),
    29500: ("torchrun's rendezvous port (recipe.schema.DEFAULT_RDZV_PORT)", "recipe.schema", {}),
    50051: ("mooncake_master's port (recipe.schema.DEFAULT_MOONCAKE_PORT)", "recipe.schema", {}),
}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string nodes that are docstrings (module, class, function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def literals(source: str) -> list[tuple[int, str | int]]:
    """(line, value) for each string (f-strings as templates) and int literal, docstrings left out."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    inside_f = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    out: list[tuple[int, str | int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append((node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)))
        elif (isinstance(node, ast.Constant) and id(node) not in skip and id(node) not in inside_f
              and (isinstance(node.value, str) or (isinstance(node.value, int) and not isinstance(node.value, bool)))):
            out.append((node.lineno, node.value))
    return out


def name_isdigit_calls(source: str) -> list[int]:
    """Lines of `<x>.name.isdigit()`: a folder judged an epoch by its name (rundir.epoch_of decides)."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "isdigit"
            and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "name"]


def second_spellings(root: Path = PKG) -> list[str]:
    found = []
    for f in sorted(root.rglob("*.py")):
        module, source = module_of(f, root), f.read_text()
        where = f"{f.relative_to(root)}"
        for line, value in literals(source):
            if isinstance(value, str):
                for rule, (pattern, owner) in STRING_RULES.items():
                    if module != owner and pattern.search(value):
                        found.append(f"{where}:{line} spells {rule}: {value!r}; ask {owner}")
            elif value in NUMBER_RULES:
                rule, owner, other_meanings = NUMBER_RULES[value]
                if module != owner and module not in other_meanings:
                    found.append(f"{where}:{line} types {value}, {rule}; ask {owner} (or, if it means something "
                                 "else here, name it in NUMBER_RULES)")
        if module != "rundir":
            found += [f"{where}:{line} judges an epoch folder by .name.isdigit(); ask rundir.epoch_of / epoch_dirs"
                      for line in name_isdigit_calls(source)]
    return found


def test_each_rule_is_spelled_by_its_owner_only():
    found = second_spellings()
    assert not found, "\n".join(found)


def test_each_owner_still_spells_its_rule():
    """The owners named above exist and hold the literal (a renamed owner would make the rule vacuous)."""
    assert name_isdigit_calls(_source("rundir")), "rundir no longer judges epoch folders by name"
    for rule, (pattern, owner) in STRING_RULES.items():
        if rule.startswith("the epoch folders"):
            continue  # its owner reads names (above), it globs nothing
        values = [v for _, v in literals(_source(owner)) if isinstance(v, str)]
        assert any(pattern.search(v) for v in values), f"{owner} no longer spells {rule}"
    for number, (rule, owner, _) in NUMBER_RULES.items():
        assert number in [v for _, v in literals(_source(owner))], f"{owner} no longer types {number} ({rule})"


def _source(module: str) -> str:
    path = PKG.joinpath(*module.split("."))
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


@pytest.mark.parametrize(("planted", "says"), [
    ('PATTERN = "bench_*.json"\n', "a bench result's file name"),
    ('def f(label):\n    return f"bench_{label}.json"\n', "a bench result's file name"),
    ('BEST = "checkpoint_best"\n', "the best checkpoint's name"),
    ('def f(p):\n    return sorted(p.glob("[0-9]*"))\n', "the epoch folders"),
    ('def f(p):\n    return [d for d in p.iterdir() if d.name.isdigit()]\n', "judges an epoch folder"),
    ('import os\nKEY = os.environ.get("DSPARK_KIT_API_KEY")\n', "the API-key variable"),
    ('def f(out):\n    return out.with_name(out.name + ".errors.jsonl")\n', "regen's failed rows"),
    ("BLOCK = 128\n", "vllm-ascend's KV block"),
    ("PORT = 8000\n", "default port"),
    ("def f(port=9736):\n    return port\n", "hidden-state server's default port"),
    ("RDZV = 29500\n", "rendezvous port"),
])
def test_a_planted_second_spelling_is_found(tmp_path, planted, says):
    """The rule can fail: the same literal planted in another module (here the CLI) is reported."""
    fake = tmp_path / "dspark_kit"
    (fake / "cli").mkdir(parents=True)
    (fake / "cli" / "planted.py").write_text('"""A docstring may say bench_x.json, checkpoint_best and 8000."""\n' + planted)
    found = second_spellings(fake)
    assert len(found) == 1 and found[0].startswith("cli/planted.py:") and says in found[0], found


def test_prose_and_other_names_are_not_second_spellings(tmp_path):
    fake = tmp_path / "dspark_kit"
    fake.mkdir()
    (fake / "report.py").write_text(
        '"""Reads bench_<label>.json and checkpoint_best (a docstring)."""\n'
        'PNG = "bench_per_position.png"  # a figure, not a bench result\n'
        "def f(which):\n    return which.isdigit()  # a recipe value, not a folder\n"
        "N = 127 + 1\n")
    assert second_spellings(fake) == []
