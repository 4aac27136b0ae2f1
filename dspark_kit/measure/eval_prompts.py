"""Eval prompts the draft never trained on, and the record of which ones were used.

Measured on the prompts a draft trained on, acceptance comes out high (one demo checkpoint:
AL 3.475 there, 3.356 on held-out prompts), so eval and tune default to held-out prompts:

- data.source builtin:tiny-chat: the tiny corpus's held-out set (its own seed, never trained on);
- data.source builtin:instructions: the kit's held-out instructions (their own seed);
- any other data: the conversations behind speculators' validation split of DIR/prepared.
  speculators validates on the last rows, prepared[int(n * train.train_data_ratio):] (its
  ArrowDataset derives both splits from that one expression); a prepared row starts a reply
  after each of its loss spans' prefixes, so a conversation belongs to the split whose rows
  start a reply after its eval prompt (the render up to its last user turn, token for token).

Either way a prompt a training row also starts a reply from is dropped (the same prompt twice
in the data), in any thinking mode the rows were rendered in (a verifier.thinking mixture has
two); a validation conversation is found in the mode prepare rendered it in. `--prompts FILE`
and `--from-data` take their rows as given; the record then counts how many of them training
rows start a reply from.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_kit.data import instructions, tiny_corpus
from dspark_kit.data.conversations import ConversationError, normalize, template_messages
from dspark_kit.data.sources import INSTRUCTIONS, TINY_CHAT
from dspark_kit.recipe import Recipe
from dspark_kit.rundir import RunDir

HELD_OUT_ROWS = 64  # the tiny corpus's held-out set: more than any eval asks for
# builtin data sources with a held-out set of their own: (its chats, what it is, the ids' prefix)
HELD_OUT_SETS = {TINY_CHAT: (tiny_corpus.eval_conversations, "the tiny corpus's held-out set", "tiny-heldout"),
                 INSTRUCTIONS: (instructions.eval_instructions, "the kit's held-out instructions", "instructions-heldout")}


class EvalError(ValueError):
    """One line naming the flag or file and the fix."""


@dataclass(frozen=True)
class PromptSource:
    """What choosing eval's prompts reads, as the stage decided it (stages/prompts.py): the recipe,
    the run folder (DIR/prepared, the rows prepare read), and how to get the verifier's tokenizer
    when a prompt must be compared with the training rows and the caller has none (called only
    then: the stage's loader may build or convert the verifier)."""

    recipe: Recipe
    run: RunDir
    load_tokenizer: Callable[[], Any]


@dataclass
class EvalPrompts:
    chats: list[list[dict]]
    ids: list[str]
    source: str
    held_out: bool | None  # None: the user's own file, not ours to judge
    trained: int | None = None  # rows training also starts a reply from (None: no DIR/prepared to ask)

    def record(self, num_prompts: int) -> dict:
        """What eval.json keeps: where the prompts came from and which rows they were."""
        return {"source": self.source, "held_out": self.held_out, "count": min(num_prompts, len(self.chats)),
                "ids": self.ids[:num_prompts], "history_ids": self.ids[num_prompts:],
                "trained_prompts": self.trained}


def until_last_user(chat: list[dict]) -> list[dict]:
    last = max(i for i, m in enumerate(chat) if m["role"] == "user")
    return chat[: last + 1]


def prompt_key(tokenizer, chat: list[dict], thinking: bool) -> tuple[int, ...]:
    """The eval prompt's tokens as prepare renders a reply's context (DIR/prepared rows)."""
    from dspark_kit.data.chat import prompt_ids

    return tuple(prompt_ids(tokenizer, template_messages(until_last_user(chat)), thinking))


def trained_on(tokenizer, chat: list[dict], recipe, trained: set[int]) -> bool:
    """A training row starts a reply from this chat's eval prompt, rendered in any mode rows have."""
    from dspark_kit.recipe.mixture import support

    return any(hash(prompt_key(tokenizer, chat, mode)) in trained for mode in support(recipe.verifier.thinking))


def has_prepared(src: PromptSource) -> bool:
    """Whether DIR/prepared holds a saved dataset (a half-written folder does not)."""
    return (src.run.prepared / "dataset_info.json").is_file()


def split_prompt_keys(src: PromptSource) -> tuple[set[int], set[int]] | None:
    """(train, validation) hashes of every context a prepared row starts a reply after; None
    without DIR/prepared."""
    prepared = src.run.prepared
    if not has_prepared(src):
        return None
    import numpy as np
    from datasets import load_from_disk

    data = load_from_disk(str(prepared)).with_format(None)  # plain lists (the saved format is torch)
    split = int(len(data) * src.recipe.train.train_data_ratio)  # speculators' ArrowDataset boundary
    keys: tuple[set[int], set[int]] = (set(), set())
    for i, (ids, mask) in enumerate(zip(data["input_ids"], data["loss_mask"], strict=True)):
        starts = np.flatnonzero(np.diff(np.asarray(mask, dtype=np.int8), prepend=0) == 1)
        keys[i >= split].update(hash(tuple(ids[:j])) for j in starts)
    return keys


def _chats(rows) -> Iterator[tuple[str, list[dict], dict]]:
    """(id, messages, row) of each usable row: its own id, else its line number."""
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            continue  # a line the reader could not parse
        try:
            yield str(row.get("id") or f"row-{i}"), normalize(row), row
        except ConversationError:
            continue


@dataclass(frozen=True)
class EvalSizes:
    """How many prompts an eval decodes, how far, and at which extra context lengths."""

    num_prompts: int
    max_new_tokens: int
    context_lengths: list[int]


def eval_sizes(recipe: Recipe, num_prompts: int | None = None, max_new_tokens: int | None = None,
               context_lengths: list[int] | None = None) -> EvalSizes:
    """The one rule for an eval's sizes: each an option given to the command, else the recipe's eval
    section (eval, its --dry-run, `tune` and the pipeline's served eval all ask it)."""
    e = recipe.eval
    lengths = context_lengths if context_lengths is not None else e.context_lengths
    return EvalSizes(num_prompts or e.num_prompts, max_new_tokens or e.max_new_tokens, sorted(set(lengths)))


def chosen_categories(recipe: Recipe, given: str | None, section: str) -> list[str]:
    """The prompt categories a measure runs: --categories, else `<section>.categories` (eval, bench),
    parsed, so a misspelt name fails (EvalError naming the flag or key) before anything loads."""
    from dspark_kit.data.categories import CategoryError, parse_categories

    try:
        return parse_categories(given if given is not None else getattr(recipe, section).categories)
    except CategoryError as e:
        raise EvalError(f"{'--categories' if given is not None else f'{section}.categories'}: {e}") from None


def served_concurrency(recipe: Recipe, concurrency: int | None = None) -> int:
    """Requests in flight when a measure goes through a server (bench, `tune --served`, the served
    eval): the command's option, else bench.concurrency."""
    return concurrency or recipe.bench.concurrency


def check_prompts_file(path: Path) -> None:
    """--prompts names a file (the run reads it; its --dry-run checks it so)."""
    if not path.is_file():
        raise EvalError(f"--prompts {path}: file not found (jsonl rows with conversations/messages/prompt)")


def _file_rows(path: Path) -> list[dict]:
    from dspark_kit.jsonl import BadLine, read_jsonl

    check_prompts_file(path)
    try:  # strict: a file that is not UTF-8 text is refused, never read as prompts of replacement characters
        rows = list(read_jsonl(path, errors="strict"))
    except (OSError, UnicodeDecodeError) as e:
        raise EvalError(f"--prompts {path}: unreadable ({type(e).__name__}); pass a UTF-8 jsonl of chats "
                        "or text lines") from None
    return [{"prompt": r.text} if isinstance(r, BadLine) else r for r in rows]  # a plain text line is a prompt


def load_eval_prompts(src: PromptSource, tokenizer, prompts_file: Path | None = None, from_data: bool = False,
                      limit: int = 64) -> EvalPrompts:
    """Conversations to take eval prompts from (at most `limit`), held out by default."""
    from dspark_kit.data.sources import iter_source

    recipe = src.recipe
    keys = split_prompt_keys(src)
    trained = keys[0] if keys else set()

    def count_trained(chats) -> int | None:
        return sum(trained_on(tokenizer, c, recipe, trained) for _, c in chats) if keys else None

    if prompts_file is not None:
        chats = [(i, c) for i, c, _ in _chats(_file_rows(prompts_file))][:limit]
        found = EvalPrompts([c for _, c in chats], [i for i, _ in chats], f"--prompts {prompts_file}", None,
                            count_trained(chats))
    elif from_data:
        chats = [(f"{recipe.data.source}#{i}", msgs) for i, msgs in iter_source(recipe.data, limit=limit)]
        found = EvalPrompts([c for _, c in chats], [i for i, _ in chats],
                            f"--from-data: the first rows of {recipe.data.source} (may be training rows)",
                            False, count_trained(chats))
    elif recipe.data.source in HELD_OUT_SETS:
        found = tiny_held_out(src, limit, tokenizer, keys)
    else:
        found = _validation_prompts(src, tokenizer, keys, limit)
    if not found.chats:
        raise EvalError(f"eval prompts: no usable conversation in {found.source} (pass --prompts FILE)")
    return found


_ASK = object()  # tiny_held_out's `keys` when the caller has not read DIR/prepared


def tiny_held_out(src: PromptSource, limit: int, tokenizer=None, keys=_ASK) -> EvalPrompts:
    """The builtin data's held-out chats (the tiny corpus's, or the kit's instructions' on
    builtin:instructions), at most `limit`: eval's default prompts on that data, and so bench's
    `builtin` prompts there (stages/serving/bench.prompt_set), so a served bench measures
    acceptance on the prompts eval measures it on.

    When the recipe trains on the tiny corpus, a prompt a training row of DIR/prepared also
    starts a reply from is dropped (other data cannot share one); the check needs the
    verifier's tokenizer (`tokenizer`, else src.load_tokenizer's). `keys`: split_prompt_keys(src),
    when the caller has read them already.
    """
    source = src.recipe.data.source
    trains_on_it = source in HELD_OUT_SETS
    held_out, label, prefix = HELD_OUT_SETS.get(source, HELD_OUT_SETS[TINY_CHAT])
    if keys is _ASK:
        keys = split_prompt_keys(src) if trains_on_it else None
    trained = keys[0] if keys else set()
    # held_out(n) is a prefix of any longer set: more than HELD_OUT_ROWS only when asked
    pool = [(f"{prefix}-{i}", c) for i, c in enumerate(held_out(max(HELD_OUT_ROWS, limit)))]
    if trained:
        if tokenizer is None:
            tokenizer = src.load_tokenizer()
        pool = [(i, c) for i, c in pool if not trained_on(tokenizer, c, src.recipe, trained)]
    chats = pool[:limit]
    if keys:
        checked = "minus any prompt a training row shares"
    else:
        checked = "not checked: no DIR/prepared" if trains_on_it else "the recipe trains on other data"
    return EvalPrompts([c for _, c in chats], [i for i, _ in chats], f"{label} ({checked})",
                       True, 0 if keys else None)


def _validation_prompts(src: PromptSource, tokenizer, keys, limit: int) -> EvalPrompts:
    from dspark_kit.data.prepare_input import input_rows
    from dspark_kit.data.template_rows import row_thinking

    ratio = src.recipe.train.train_data_ratio
    if keys is None or not 0 < ratio < 1:
        why = (f"no prepared data in {src.run.prepared} (run prepare)" if keys is None
               else f"train.train_data_ratio {ratio} leaves no validation split")
        raise EvalError(f"eval prompts: {why}; pass --prompts FILE (chats the draft never trained on), or "
                        "--from-data (the data source's first rows: they may be training rows)")
    trained, held = keys
    recipe = src.recipe
    tokenizer = tokenizer if tokenizer is not None else src.load_tokenizer()  # the caller may have none
    rows, _total, _unusable, source = input_rows(recipe, src.run)
    chats = []
    for i, c, row in _chats(rows):
        try:  # the mode prepare rendered the row in: its validation rows start from that prompt
            mode = row_thinking(row, recipe.verifier.thinking, recipe.mixture_seed)
        except ConversationError:
            continue  # prepare rejected it too
        if hash(prompt_key(tokenizer, c, mode)) in held and not trained_on(tokenizer, c, recipe, trained):
            chats.append((i, c))
            if len(chats) >= limit:
                break
    return EvalPrompts([c for _, c in chats], [i for i, _ in chats],
                       f"speculators' validation split of {src.run.prepared} (train.train_data_ratio {ratio}) "
                       f"in {source}", True, 0)


def plan_line(recipe: Recipe) -> str:
    """Which prompts the pipeline's eval will use, for dry runs."""
    if recipe.data.source in HELD_OUT_SETS:
        return f"prompts: {HELD_OUT_SETS[recipe.data.source][1]}"
    return (f"prompts: speculators' validation split of DIR/prepared (train.train_data_ratio "
            f"{recipe.train.train_data_ratio})")


def category_prompts(src: PromptSource, specs: list[str], per_category: int, tokenizer=None,
                     where: str = "--categories") -> list:
    """Each category's prompts (data.categories.CategoryPrompts), at most `per_category` each, in
    the order asked; `tiny` stands for one category per task template of the tiny corpus's held-out
    set (the prompts eval and bench measure by default on the tiny data, grouped by template)."""
    from dspark_kit.data.categories import TINY, CategoryPrompts, load_category
    from dspark_kit.data.tiny_corpus import TASK_KINDS, task_kind

    out = []
    for spec in specs:
        if spec != TINY:
            out.append(load_category(spec, per_category, where))
            continue
        # six templates drawn at random: twice the share of each keeps every kind filled
        found = tiny_held_out(src, 2 * len(TASK_KINDS) * per_category, tokenizer)
        by_kind: dict[str, CategoryPrompts] = {
            k: CategoryPrompts(f"tiny/{k}", found.source, [], []) for k in TASK_KINDS}
        for i, chat in zip(found.ids, found.chats, strict=True):
            group = by_kind[task_kind(chat[0]["content"])]
            if len(group.chats) < per_category:
                group.chats.append(until_last_user(chat))
                group.ids.append(i)
        out += [g for g in by_kind.values() if g.chats]
    return out


def build_prompts(tokenizer, chats: list[list[dict]], num_prompts: int, thinking: bool,
                  context_length: int = 0, seed: int = 0) -> list[list[int]]:
    """Prompt token ids; with context_length > 0, earlier chats are prepended as history."""
    from dspark_kit.data.chat import prompt_ids

    rng = random.Random(seed)
    out = []
    for i, chat in enumerate(chats[:num_prompts]):
        msgs = until_last_user(chat)
        history: list[dict] = []
        others = [c for j, c in enumerate(chats) if j != i] or [chat]
        while context_length and len(prompt_ids(tokenizer, history + msgs, thinking)) < context_length:
            history = list(rng.choice(others)) + history
        ids = prompt_ids(tokenizer, history + msgs, thinking)
        if context_length and len(ids) > context_length:  # trim history from the left, keep the prompt whole
            keep = max(context_length, len(prompt_ids(tokenizer, msgs, thinking)))
            ids = ids[-keep:]
        out.append(ids)
    return out
