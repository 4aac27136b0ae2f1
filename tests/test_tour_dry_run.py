"""docs/TOUR.md names every command that has --dry-run, and no other (the CLI is the list)."""

from __future__ import annotations

import re
from pathlib import Path

import click
import typer

from dspark_kit.cli import app

TOUR = Path(__file__).resolve().parents[1] / "docs" / "TOUR.md"


def dry_run_commands(group: click.Group, prefix: str = "") -> set[str]:
    out = set()
    for name, cmd in group.commands.items():
        full = f"{prefix} {name}".strip()
        if isinstance(cmd, click.Group):
            out |= dry_run_commands(cmd, full)
        elif any("--dry-run" in p.opts for p in cmd.params):
            out.add(full)
    return out


def test_the_tour_lists_the_commands_with_a_dry_run():
    text = " ".join(TOUR.read_text().split())
    sentence = text[text.index("Plan on a laptop, run on the cluster:"):].split(" prints the exact commands")[0]
    named = set(re.findall(r"`([a-z][a-z -]*)`", sentence)) - {"--dry-run"}
    assert named == dry_run_commands(typer.main.get_command(app)), sentence
