"""The embedded chat corpus for the tiny verifier and the CPU demo.

Built deterministically from the word list in `assets/words.txt`. Replies
depend on the prompt (describe, tell a story, count, write a poem, make a
sentence, suggest a title: templates filled with the words the prompt names), so
draft acceptance on this corpus measures something real rather than a reply
the model could produce without reading the user turn.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from importlib import resources
from pathlib import Path


@lru_cache(maxsize=1)
def vocabulary() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    current = None
    for line in resources.files("dspark_kit.data.assets").joinpath("words.txt").read_text().splitlines():
        if line.startswith("# "):
            current = line[2:].strip()
            groups[current] = []
        elif line.strip() and current:
            groups[current].append(line.strip())
    return groups


def sentence(rng: random.Random) -> str:
    v = vocabulary()
    return (
        f"the {rng.choice(v['adjectives'])} {rng.choice(v['nouns'])} {rng.choice(v['verbs'])} "
        f"the {rng.choice(v['nouns'])} {rng.choice(v['places'])}."
    )


def _pick(rng: random.Random, group: str) -> str:
    return rng.choice(vocabulary()[group])


# the task templates in _task's order: each one names an eval category of the tiny corpus
TASK_KINDS = ("describe", "story", "count", "poem", "sentence", "title")


def _task(rng: random.Random) -> tuple[str, str, str]:
    """(prompt, reply, one-line reasoning) for one randomly chosen task.

    Each reply is a fixed template filled with words the prompt names (one of each
    class: noun, adjective, verb, place), or a count between two numbers the prompt
    gives. A tiny verifier learns that in a few minutes on 2 cores: it has to find the
    prompt's noun/adjective/... (attention by word class) and fill the template.
    Tasks that copy whole word lists in order (repeat, reverse, sort) need induction
    heads, which this model did not form within ~3000 steps; its replies were then
    paraphrases no draft could predict (issue 13).
    """
    kind = rng.randrange(6)
    n, a, v, p = (_pick(rng, g) for g in ("nouns", "adjectives", "verbs", "places"))
    if kind == 0:
        return (f"Describe the {a} {n}.", f"The {n} is very {a}. I have never seen a {n} so {a}.",
                f"The user wants a description of the {a} {n}.")
    if kind == 1:
        return (f"Tell a story about a {n} {p}.",
                f"Once upon a time there was a {n} that lived {p}. Every day the {n} played {p}. The end.",
                f"A short story about the {n}.")
    if kind == 2:
        lo = rng.randint(1, 80)
        hi = lo + rng.randint(4, 12)
        return (f"Count from {lo} to {hi}.", ", ".join(str(i) for i in range(lo, hi + 1)) + ".",
                f"I count up by one from {lo} until {hi}.")
    if kind == 3:
        return (f"Write a poem about the {a} {n} that {v} things.",
                f"Oh {a} {n}, you {v} so well,\nthe {a} {n} {v} and all is well.",
                f"A two-line poem about the {n}.")
    if kind == 4:
        return (f"Make a sentence with {n}, {v} and {p}.", f"The {n} {v} the ball {p}. That is my sentence.",
                f"I use {n}, {v} and {p} in one sentence.")
    return (f"Give me a title for a book about the {a} {n}.",
            f"\"The {a} {n}\" is a good title for a book about a {a} {n}.",
            f"A title about the {n}.")


_OPENINGS = (("Describe the ", "describe"), ("Tell a story ", "story"), ("Count from ", "count"),
             ("Write a poem ", "poem"), ("Make a sentence ", "sentence"), ("Give me a title ", "title"))


def task_kind(prompt: str) -> str:
    """Which of TASK_KINDS a tiny-corpus prompt is (its template's opening words say it)."""
    for opening, kind in _OPENINGS:
        if prompt.startswith(opening):
            return kind
    raise ValueError(f"not a tiny-corpus prompt: {prompt[:40]!r}")



def conversation(rng: random.Random, max_turns: int = 2) -> list[dict[str, str]]:
    """Chat messages (OpenAI style) with 1..max_turns user/assistant pairs."""
    msgs: list[dict[str, str]] = []
    for _ in range(rng.randint(1, max_turns)):
        prompt, reply, _ = _task(rng)
        msgs += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    return msgs


def conversations(n: int, seed: int = 0, max_turns: int = 2) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [conversation(rng, max_turns) for _ in range(n)]


def thinking_reply(rng: random.Random) -> tuple[str, str, str]:
    """(prompt, reply, one-line reasoning) of one task: a family's reasoning format writes the reply
    (data/reasoning_formats.py `corpus_reply`: Qwen3's inline think block, Harmony's channels)."""
    return _task(rng)


def write_regen_style_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    """The shipped prompts as regen-schema rows (used before regen runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for i, msgs in enumerate(conversations(n, seed)):
            conv = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in msgs]
            f.write(json.dumps({"id": f"tiny-{i}", "conversations": conv, "metadata": {"idx": i}}) + "\n")
    tmp.replace(path)
    return path


EVAL_SEED = 9173  # held out: not the corpus seed the tiny verifier or the demo draft trained on


def eval_conversations(n: int = 32, seed: int = EVAL_SEED) -> list[list[dict[str, str]]]:
    """The held-out single-turn chats (with the corpus reply): `dspark-kit eval`'s default
    prompts on the tiny data (rows a training row shares a prompt with are dropped there)."""
    return conversations(n, seed=seed, max_turns=1)


def write_eval_prompts(path: Path, n: int = 32, seed: int = EVAL_SEED) -> Path:
    """Held-out single-turn chats (with the corpus reply) as jsonl `{"messages": [...]}` rows.

    `dspark-kit eval --prompts` takes the prompt of the first `--num-prompts` rows and,
    for `--context-lengths`, prepends the other rows as earlier turns (a multi-turn chat
    of 1k-2k tokens); `dspark-kit bench --prompts` sends the same first turns, so eval
    and bench measure the same prompts.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for msgs in eval_conversations(n, seed):
            f.write(json.dumps({"messages": msgs}) + "\n")
    tmp.replace(path)
    return path
