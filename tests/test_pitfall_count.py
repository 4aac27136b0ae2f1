"""One pitfall count, the registry's (findings.PITFALLS): README, docs/PITFALLS.md and `preflight
--help` say the same number, and PITFALLS.md has one numbered section per registered pitfall."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.findings import PITFALLS, pitfall_count

REPO = Path(__file__).resolve().parents[1]
COUNTED = re.compile(r"\b(\w+) (?:silent )?pitfalls\b|\bPitfalls: (\w+) ways\b", re.IGNORECASE)
NUMBER_WORDS = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"}


def counts(text: str) -> set[str]:
    """The numbers a text gives the pitfalls ("the eleven silent pitfalls" -> {"eleven"})."""
    found = {(a or b).lower() for a, b in COUNTED.findall(text)}
    return {w for w in found if w in NUMBER_WORDS or w.isdigit()}


def test_every_count_is_the_registrys():
    help_text = CliRunner().invoke(app, ["preflight", "--help"], terminal_width=200).output
    for where, text in {"README.md": (REPO / "README.md").read_text(),
                        "docs/PITFALLS.md": (REPO / "docs" / "PITFALLS.md").read_text(),
                        "preflight --help": help_text}.items():
        assert counts(text) == {pitfall_count()}, f"{where} counts {counts(text)}; the registry has {pitfall_count()}"


def test_pitfalls_md_has_one_section_per_registered_pitfall():
    numbered = [int(n) for n in re.findall(r"^## (\d+)\. ", (REPO / "docs" / "PITFALLS.md").read_text(), re.MULTILINE)]
    assert numbered == sorted(PITFALLS)


def test_the_count_check_sees_a_stale_number():
    assert counts("preflight checks the ten silent pitfalls") == {"ten"}
    assert counts("# Pitfalls: eleven ways to ruin acceptance") == {"eleven"}
