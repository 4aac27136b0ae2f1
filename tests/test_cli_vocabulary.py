"""One flag name per idea: every command of the real app is held to cli/vocabulary.py's table."""

from __future__ import annotations

import json
import re

import pytest
import typer
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.cli.vocabulary import VOCABULARY, command_aliases, translate


def _commands(cmd, path=()):
    subs = getattr(cmd, "commands", None)
    if subs is None:
        yield " ".join(path), cmd
        return
    for name, sub in subs.items():
        yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands(typer.main.get_command(app)))


def _options(cmd):
    return [p for p in cmd.params if p.param_type_name == "option"]


def _alias_uses():
    """(command, old spelling, canonical flag, the option it lands in) for every alias a command accepts."""
    for name, cmd in COMMANDS.items():
        for old, new in command_aliases(cmd.params).items():
            target = next(p for p in _options(cmd) if new in p.opts)
            yield pytest.param(name, old, new, target, id=f"{name}:{old}")


def test_the_walk_sees_every_command():
    # the table's checks below are only as good as the walk: it must reach nested commands too
    assert {"regen", "init", "eval", "tune", "bench", "doctor", "report", "window plan", "window tune",
            "recipe show"} <= set(COMMANDS)


def test_the_table_names_each_idea_once():
    canonical = [f for flag in VOCABULARY.values() for f in flag.flags]
    assert len(canonical) == len(set(canonical)), "a flag is canonical for two ideas"
    aliases = {a for flag in VOCABULARY.values() for a in flag.aliases}
    assert not aliases & set(canonical), "an old spelling is also a canonical flag"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_options_use_the_canonical_names(name):
    cmd = COMMANDS[name]
    for p in _options(cmd):
        for idea, flag in VOCABULARY.items():  # a table name means the table's idea, in every command
            if set(p.opts) & set(flag.flags):
                assert set(p.opts) == set(flag.flags), f"{name} {p.opts}: {idea!r} is spelled {flag.flags}"
        # an option that expresses an idea (its parameter name says so) is spelled as the table says;
        # `dataset` was data in regen and prompts in bench, so a name may point at more than one idea
        spellings = [flag.flags for flag in VOCABULARY.values() if p.name in flag.dests]
        if spellings:
            assert set(p.opts) in [set(s) for s in spellings], f"{name} {p.opts}: spelled {spellings}"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_old_spellings_are_hidden_and_unambiguous(name):
    cmd = COMMANDS[name]
    live = {o for p in _options(cmd) for o in (*p.opts, *p.secondary_opts)}
    accepted = command_aliases(cmd.params)
    assert not set(accepted) & live, f"{name}: an old spelling is still a visible option"
    for old in accepted:  # one old spelling must land in one option of this command
        targets = [f.name for f in VOCABULARY.values() if old in f.aliases and f.name in live]
        assert len(targets) == 1, f"{name}: {old} could mean {targets}"
    shown = CliRunner().invoke(app, [*name.split(), "--help"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    for old in accepted:
        assert not re.search(rf"(?<![\w-]){re.escape(old)}(?![\w-])", shown.output), f"{name} --help shows {old}"


@pytest.mark.parametrize(("name", "old", "new", "target"), list(_alias_uses()))
def test_every_old_spelling_still_parses(name, old, new, target):
    cmd = COMMANDS[name]
    args = [old] if target.is_flag else [old, "7"]
    for p in _options(cmd):  # required options other than the one under test get a plain value
        if p.required and p is not target:
            args += [p.opts[0], "1"]
    args = ["1" for p in cmd.params if p.param_type_name == "argument" and p.required] + args  # and arguments
    notes: list[tuple[str, str]] = []
    ctx = cmd.make_context(name, translate(cmd.params, args, lambda a, b: notes.append((a, b))))
    value = ctx.params[target.name]
    value = value[0] if isinstance(value, list | tuple) else value
    assert (value is True) if target.is_flag else (str(value) == "7"), f"{name} {old} -> {target.name}={value!r}"
    assert notes == [(old, new)]


def test_an_old_spelling_runs_the_command_and_says_the_new_name():
    runner = CliRunner()
    new = runner.invoke(app, ["window", "plan", "--context-lengths", "10,60", "-W", "64", "--json"])
    old = runner.invoke(app, ["window", "plan", "--context-lens=10,60", "--window", "64", "--json"])
    assert new.exit_code == old.exit_code == 0, old.output
    assert json.loads(old.stdout) == json.loads(new.stdout)
    assert "--context-lens is deprecated, use --context-lengths" in old.stderr
    assert "--window is deprecated, use --draft-window-size" in old.stderr
    assert "deprecated" not in new.stderr


def test_a_value_that_looks_like_an_old_flag_is_left_alone():
    regen = COMMANDS["regen"]
    args = ["--set", "--outfile", "--outfile", "x.jsonl", "--", "--dataset"]
    assert translate(regen.params, args) == ["--set", "--outfile", "--out", "x.jsonl", "--", "--dataset"]


def test_device_and_dataset_say_which_they_are():
    # once one name for three devices and for two kinds of data; now each command's own
    accepted = {name: command_aliases(cmd.params) for name, cmd in COMMANDS.items()}
    assert accepted["init"]["--device"] == "--target-device"
    assert accepted["eval"]["--device"] == accepted["tune"]["--device"] == "--eval-device"
    assert accepted["doctor"]["--device"] == "--probe-device"
    assert accepted["regen"]["--dataset"] == "--data"
    assert accepted["bench"]["--dataset"] == "--prompts"


def test_report_takes_the_run_dir_as_every_command_does(tmp_path):
    runner = CliRunner()
    missing = tmp_path / "no-run"
    by_flag = runner.invoke(app, ["report", "-w", str(missing)])
    assert by_flag.exit_code == 2 and str(missing) in by_flag.output  # -w is read, not the recipe's workdir
    twice = runner.invoke(app, ["report", str(tmp_path / "a"), "-w", str(tmp_path / "b")])
    assert twice.exit_code == 2 and "run directory given twice" in twice.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_command_list_shows_a_whole_sentence(name):
    """`dspark-kit --help` lists each command by its help's first paragraph: a sentence, not a
    paragraph cut at its example."""
    first = " ".join((COMMANDS[name].help or "").split("\n\n")[0].split())
    assert first and not first.endswith(":"), f"{name}: {first!r}"
