"""One flag name per idea on the command line.

VOCABULARY maps each idea that more than one command expresses to its canonical flag, its help
text and the old spellings it replaced. Commands declare such options with `option(idea)`, so
the same idea has the same name everywhere; tests/test_cli_vocabulary.py walks the real app and
holds every command to this table.

Old spellings are accepted for one release and hidden: they are not options at all (so `--help`
never shows them); `VocabularyCommand.parse_args` rewrites them to the canonical flag of the
command's own option before parsing, with a one-line note on stderr. One old spelling can stand
for different ideas in different commands (`--device`, `--dataset` did), so it is resolved per
command, against the options that command declares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer

from dspark_kit.rundir import BEST_CHECKPOINT

# what a --checkpoint names (specdec.checkpoints.resolve_checkpoint reads each)
CHECKPOINT_CHOICES = f"{BEST_CHECKPOINT} | latest | epoch number | epochN_end | PATH"
from typer.core import TyperCommand


@dataclass(frozen=True)
class Flag:
    flags: tuple[str, ...]  # canonical long name first, then its short form if any
    help: str
    aliases: tuple[str, ...] = ()  # old spellings: hidden, accepted until the next release
    dests: tuple[str, ...] = ()  # the parameter names commands give this idea (the test finds it by them)

    @property
    def name(self) -> str:
        return self.flags[0]


VOCABULARY: dict[str, Flag] = {
    "recipe": Flag(("--recipe", "-r"), "Recipe YAML (see recipes/).", dests=("recipe",)),
    "set": Flag(("--set",), "Override a recipe value, e.g. --set train.epochs=3 (repeatable).", dests=("set_",)),
    "workdir": Flag(("--workdir", "-w"), "Run directory (default: the recipe's workdir).", dests=("workdir",)),
    "dry_run": Flag(("--dry-run",), "Print the plan (exact commands, ports, paths, decided values) and exit; "
                    "with --json, the plan as data: what the run executes and records in DIR/plans/.",
                    dests=("dry_run",)),
    "json": Flag(("--json",), "Machine-readable JSON on stdout.", dests=("json_out",)),
    "out": Flag(("--out", "-o"), "Where the command writes its result.",
                aliases=("--outfile", "--output"), dests=("out", "outfile", "output")),
    "max_new_tokens": Flag(("--max-new-tokens",), "Most tokens generated per reply (the prompt not counted).",
                           aliases=("--max-tokens",), dests=("max_new_tokens", "max_tokens")),
    # the recipe's data.source (chats to train on); not --prompts, the prompts a measurement sends
    "data": Flag(("--data",), "Chat data, the recipe's data.source: builtin:tiny-chat, a preset (ultrachat, "
                             "gsm8k, ...), hf:NAME[:CONFIG]:SPLIT, a jsonl/json/parquet file or a save_to_disk "
                             "folder (docs/DATA.md).", aliases=("--dataset",), dests=("data", "dataset")),
    "prompts": Flag(("--prompts",), "Prompts to send: a chat jsonl (conversations/messages/prompt; the first "
                                    "user turn is sent) or plain text lines.",
                    aliases=("--dataset",), dests=("prompts", "dataset")),
    "categories": Flag(("--categories",), "Named prompt sets, one acceptance figure each, comma-separated: "
                                          "mt-bench, gsm8k, humaneval, alpaca, summarization, qa, tiny, NAME=FILE; "
                                          "none: off.", dests=("categories",)),
    "num_prompts": Flag(("--num-prompts",), "How many prompts to send.", dests=("num_prompts",)),
    "concurrency": Flag(("--concurrency",), "Requests in flight.", dests=("concurrency",)),
    "endpoint": Flag(("--endpoint", "-e"), "A running OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 "
                                           "(the /v1 is optional).", aliases=("--base-url",),
                     dests=("endpoint", "base_url")),
    "checkpoint": Flag(("--checkpoint",), f"{CHECKPOINT_CHOICES}, relative "
                                          "to DIR/checkpoints (default: serve.checkpoint).", dests=("checkpoint",)),
    "context_lengths": Flag(("--context-lengths",), "Comma-separated context lengths in tokens, e.g. 512,1024.",
                            aliases=("--context-lens",), dests=("context_lengths", "context_lens")),
    "draft_window_size": Flag(("--draft-window-size", "-W"), "The draft KV window W (serve.draft_window_size).",
                              aliases=("--window",), dests=("draft_window_size", "window")),
    # three different devices once shared --device; each now says which it is
    "target_device": Flag(("--target-device",), "cpu, cuda, npu, or auto (this machine's): the accelerator the "
                                                "recipe is written for.", aliases=("--device",),
                          dests=("target_device",)),
    "eval_device": Flag(("--eval-device",), "auto, cpu, cuda or npu (cuda:1 ...): where the in-process verifier "
                                            "and draft run (default: where training runs).", aliases=("--device",),
                        dests=("eval_device",)),
    "probe_device": Flag(("--probe-device",), "auto, cpu, cuda or npu: the device whose speculators probes run.",
                         aliases=("--device",), dests=("probe_device",)),
    "launcher": Flag(("--launcher",), "local (default): run here | slurm: write one batch script for the recipe's "
                                      "whole topology (the recipe's slurm: section), sbatch it and follow the job; "
                                      "with --dry-run, print that script as it would be submitted.",
                     dests=("launcher",)),
    "overwrite": Flag(("--overwrite",), "Replace an existing output.", aliases=("--force",), dests=("overwrite",)),
}


def option(idea: str, help: str | None = None, **kwargs: Any) -> Any:
    """The typer.Option for `idea` under its canonical flags; `help` says what it is in this command."""
    flag = VOCABULARY[idea]
    return typer.Option(*flag.flags, help=help or flag.help, **kwargs)


def command_aliases(params: list[Any]) -> dict[str, str]:
    """Old spelling -> canonical flag, for the options this command declares."""
    mine = {opt for p in params for opt in getattr(p, "opts", ())}
    return {old: flag.name for flag in VOCABULARY.values() if flag.name in mine for old in flag.aliases
            if old not in mine}  # a command that still declares an old name as a live option keeps it


def translate(params: list[Any], args: list[str], note=None) -> list[str]:
    """`args` with this command's old spellings replaced by the canonical flags; `note(old, new)` per use."""
    aliases = command_aliases(params)
    takes_value = {opt for p in params if getattr(p, "param_type_name", "") == "option" and not p.is_flag
                   and not p.count for opt in p.opts}
    out: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":  # everything after is positional
            out.extend(args[i:])
            break
        name, eq, value = word.partition("=")
        if name in aliases:
            if note is not None:
                note(name, aliases[name])
            name = aliases[name]
            word = name + eq + value
        out.append(word)
        if name in takes_value and not eq and i + 1 < len(args):  # the value is never a flag to rewrite
            out.append(args[i + 1])
            i += 1
        i += 1
    return out


class VocabularyCommand(TyperCommand):
    """A command that still accepts the old spellings of its options (hidden, for one release)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        def note(old: str, new: str) -> None:
            if not ctx.resilient_parsing:  # not during shell completion
                typer.echo(f"note: {old} is deprecated, use {new} (the old spelling goes in the next release)",
                           err=True)

        return super().parse_args(ctx, translate(self.params, args, note))


def install(app: typer.Typer) -> None:
    """Every command of `app` and its sub-apps parses old spellings (cli/__init__ calls it once)."""
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):  # the default; a command with its own class keeps it
            info.cls = VocabularyCommand
    for group in app.registered_groups:
        if group.typer_instance is not None:
            install(group.typer_instance)
