"""One module decides a draft's anchor layout (specdec/anchor.py): no other module reads
`sample_from_anchor` with a default of its own, nor decides what a missing key means (not even the kit's patches of
speculators, nor the probe that runs inside vLLM's interpreter).

A wrong layout accepts almost nothing and raises no error, and the loaders read a missing key
differently (vLLM's DSpark runtime true, its speculators loader false), so a second spelling of the
default is how a draft ends up served the other way. Flagged, outside specdec/anchor.py:
`x.get("sample_from_anchor", default)`, `getattr(x, "sample_from_anchor", default)`,
`"sample_from_anchor" in x` / `not in x`, and `... if sample_from_anchor is None else ...`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "dspark_kit"
KEY = "sample_from_anchor"
RULE = "specdec/anchor.py"
def _is_key(node) -> bool:
    return isinstance(node, ast.Constant) and node.value == KEY


def _none(node) -> bool:  # a default of None decides nothing: absent stays absent
    return isinstance(node, ast.Constant) and node.value is None


def _names_key(node) -> bool:
    return any(isinstance(n, ast.Name) and n.id == KEY or isinstance(n, ast.Attribute) and n.attr == KEY
               for n in ast.walk(node))


def _spells_default(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "get":  # x.get(KEY, default)
            return len(node.args) >= 2 and _is_key(node.args[0]) and not _none(node.args[1])
        if isinstance(f, ast.Name) and f.id == "getattr":  # getattr(x, KEY, default)
            return len(node.args) >= 3 and _is_key(node.args[1]) and not _none(node.args[2])
        return False
    if isinstance(node, ast.Compare):  # KEY in x / KEY not in x
        return _is_key(node.left) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
    if isinstance(node, ast.IfExp) and isinstance(node.test, ast.Compare):  # ... if sample_from_anchor is None else ...
        return _names_key(node.test) and any(isinstance(c, ast.Constant) and c.value is None
                                             for c in node.test.comparators)
    return False


def defaults_spelled(tree: ast.AST) -> list[int]:
    """Lines where a module decides what a missing sample_from_anchor means."""
    return [node.lineno for node in ast.walk(tree) if _spells_default(node)]


def test_the_missing_key_default_lives_in_one_module():
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).as_posix()
        if rel == RULE:
            continue
        offenders += [f"dspark_kit/{rel}:{line}" for line in defaults_spelled(ast.parse(f.read_text()))]
    assert not offenders, f"ask dspark_kit.specdec.anchor.anchor_layout instead: {offenders}"


def test_the_rule_module_is_where_the_defaults_are():
    text = (PKG / RULE).read_text()
    assert "_READ_WHEN_MISSING" in text  # the loaders' readings of a missing key, in one table
    for f in PKG.rglob("*.py"):
        if f.relative_to(PKG).as_posix() != RULE:
            assert "_READ_WHEN_MISSING" not in f.read_text(), f


def test_the_detector_catches_each_spelling():
    """The scan itself can fail: each spelling it bans, written out, is found."""
    bad = ['cfg.get("sample_from_anchor", True)', 'getattr(c, "sample_from_anchor", False)',
           '"sample_from_anchor" in cfg', '"sample_from_anchor" not in cfg',
           'x = True if sample_from_anchor is None else sample_from_anchor',
           'y = 1 if cfg.sample_from_anchor is None else 2']
    for src in bad:
        assert defaults_spelled(ast.parse(src)) == [1], src
    fine = ['cfg.get("sample_from_anchor")', 'getattr(c, "sample_from_anchor", None)', 'out = {"sample_from_anchor": True}', 'anchor_layout(cfg).slots']
    for src in fine:
        assert defaults_spelled(ast.parse(src)) == [], src


def _bool_anchor_constants(tree: ast.AST) -> list[int]:
    """Lines that bind a name about the anchor layout to a bare True/False (the kit trainer's layout
    spelled again, as engine_table's KIT_SAMPLE_FROM_ANCHOR = True once was)."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, bool)
            and any(isinstance(t, ast.Name) and "ANCHOR" in t.id.upper()
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]


def test_the_kit_trainers_layout_is_one_constant():
    offenders = [f"dspark_kit/{f.relative_to(PKG).as_posix()}:{line}" for f in sorted(PKG.rglob("*.py"))
                 if f.relative_to(PKG).as_posix() != RULE
                 for line in _bool_anchor_constants(ast.parse(f.read_text()))]
    assert not offenders, f"import specdec.anchor.KIT_TRAINS instead: {offenders}"
    assert _bool_anchor_constants(ast.parse("KIT_SAMPLE_FROM_ANCHOR = True")) == [1]
    assert _bool_anchor_constants(ast.parse("from x import KIT_TRAINS as KIT_SAMPLE_FROM_ANCHOR")) == []
