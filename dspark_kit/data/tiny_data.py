"""The embedded chat corpus for the tiny verifier and the CPU demo.

Built deterministically from the word list in `assets/words.txt`. Replies
depend on the prompt (repeat, reverse, capitalise, count, sort, continue), so
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


def _words(rng: random.Random, n: int) -> list[str]:
    return rng.sample(vocabulary()["nouns"], n)


def _task(rng: random.Random) -> tuple[str, str, str]:
    """(prompt, reply, one-line reasoning) for one randomly chosen task."""
    kind = rng.randrange(6)
    if kind == 0:
        s = sentence(rng)
        return f"Repeat after me: {s}", s, "The user wants the sentence repeated exactly."
    if kind == 1:
        w = _words(rng, rng.randint(3, 7))
        return (f"Reverse the order of these words: {' '.join(w)}", " ".join(reversed(w)),
                "I list the same words from last to first.")
    if kind == 2:
        s = sentence(rng)
        return f"Write this in capital letters: {s}", s.upper(), "Every letter becomes a capital."
    if kind == 3:
        a = rng.randint(1, 80)
        b = a + rng.randint(4, 12)
        return (f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + ".",
                f"I count up by one from {a} until {b}.")
    if kind == 4:
        w = _words(rng, rng.randint(3, 7))
        return (f"Sort these words alphabetically: {', '.join(w)}", ", ".join(sorted(w)),
                "I put the words in alphabetical order.")
    s1, s2 = sentence(rng), sentence(rng)
    return (f"Continue the story: {s1}", f"{s1} Then {s2} The end.",
            "I keep the first sentence and add what happens next.")


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


def thinking_reply(rng: random.Random) -> tuple[str, str]:
    prompt, reply, reasoning = _task(rng)
    return prompt, f"<think>\n{reasoning}\n</think>\n\n{reply}"


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


def write_eval_prompts(path: Path, n: int = 32, seed: int = EVAL_SEED) -> Path:
    """Held-out single-turn chats (with the corpus reply) as jsonl `{"messages": [...]}` rows.

    `dspark-kit eval --prompts` takes the prompt of the first `--num-prompts` rows and,
    for `--context-lengths`, prepends the other rows as earlier turns (a multi-turn chat
    of 1k-2k tokens); `dspark-kit bench --dataset` sends the same first turns, so eval
    and bench measure the same prompts.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for msgs in conversations(n, seed=seed, max_turns=1):
            f.write(json.dumps({"messages": msgs}) + "\n")
    tmp.replace(path)
    return path
