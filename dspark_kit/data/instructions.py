"""The kit's instruction set (`data.source: builtin:instructions`): varied prompts for a real
instruct model, generated here, so a CPU rehearsal on a real LLM (recipes/smollm2-135m-cpu.yaml)
trains on more than the tiny corpus's six templates, with no hub.

Each prompt is one of many task types (explain, list, compare, how-to, define, advice, a haiku,
an email, a summary or rewrite of a given text, arithmetic word problems, a small
Python function, a classification, a translation of a phrase, a question with facts to reason
over ...) about one of many topics, with a length hint ("in one sentence", "in three bullet
points", "in a short paragraph"), so replies have many lengths but stay short enough for a CPU
regen. The rows are user turns only: regen writes the verifier's own replies (on-policy). Tasks a
small model answers in a greedy loop (multi-sentence stories, trip plans, four-line poems: over half
of SmolLM2-135M's replies to them ran past 256 tokens) are left out: a cut reply's row is dropped.

`instruction_conversations(n, seed)` draws them from `seed`; the held-out set
(`eval_instructions`) uses its own seed, and drops any prompt the training seed's first
`HELD_OUT_GUARD` rows also ask, so eval never measures a prompt training saw verbatim.

Layer 1 (data/): imports nothing of the kit.
"""

from __future__ import annotations

import random

INSTRUCTIONS = "builtin:instructions"
TRAIN_SEED = 0
EVAL_SEED = 4242  # held out: not the seed regen's training rows are drawn from
HELD_OUT_GUARD = 4096  # training rows whose prompts the held-out set is checked against

TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "the moon", "black holes", "rainbows", "earthquakes",
    "the human heart", "sleep", "vaccines", "bees", "coral reefs", "the Roman Empire", "the printing press",
    "the internet", "electric cars", "solar panels", "recycling", "climate change", "the stock market",
    "inflation", "compound interest", "a budget", "machine learning", "databases", "encryption",
    "the Python programming language", "version control", "cloud computing", "public libraries", "chess",
    "soccer", "marathon training", "healthy breakfasts", "baking bread", "coffee", "tea", "gardening",
    "houseplants", "dogs", "cats", "birds migrating", "the ocean", "deserts", "rainforests", "mountains",
    "the solar system", "gravity", "magnets", "electricity", "sound", "light", "DNA", "the immune system",
    "meditation", "time management", "public speaking", "job interviews", "learning a language",
    "reading books", "museums", "bicycles", "trains", "airplanes", "bridges", "skyscrapers", "maps",
    "the weather", "snow", "friendship", "teamwork", "kindness", "music", "painting", "photography",
    "movies", "video games", "smartphones", "email etiquette", "online privacy", "passwords",
)
PEOPLE = ("a child", "a beginner", "a busy parent", "a new employee", "a student", "a retiree", "a tourist",
          "a small business owner")
ITEMS = ("apples", "books", "pencils", "tickets", "cookies", "marbles", "stamps", "chairs", "boxes", "coins")
NAMES = ("Alice", "Ben", "Carla", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal")
ADJECTIVES = ("quiet", "busy", "old", "small", "bright", "cold", "friendly", "strange", "tiny", "famous")
PLACES = ("a lighthouse", "a train station", "a bakery", "a forest", "a library", "a mountain village",
          "a space station", "a market", "a farm", "an island")
LANGUAGES = ("French", "Spanish", "German", "Italian")
PHRASES = ("good morning", "thank you very much", "where is the station", "I like to read",
           "the weather is nice today", "see you tomorrow")
PY_TASKS = ("returns the sum of a list of numbers", "reverses a string", "counts the vowels in a string",
            "returns the largest of three numbers", "checks whether a number is prime",
            "returns the factorial of n", "removes duplicates from a list while keeping order",
            "checks whether a word is a palindrome", "converts Celsius to Fahrenheit",
            "returns the average of a list", "counts how often each word appears in a sentence",
            "returns the n-th Fibonacci number", "merges two sorted lists", "finds the index of the smallest item")
SHORT = ("in one sentence", "in one or two sentences", "briefly", "in under 30 words")
MEDIUM = ("in three sentences", "in a short paragraph", "in three bullet points", "in four short steps")
LONGER = ("in two short paragraphs", "in five bullet points", "with a short example")


def _length(rng: random.Random) -> str:
    pool = rng.choices((SHORT, MEDIUM, LONGER), weights=(5, 5, 1))[0]
    return rng.choice(pool)


def _text(rng: random.Random) -> str:
    """A small passage to summarize or rewrite: a few plain sentences about a topic."""
    topic, person, place = rng.choice(TOPICS), rng.choice(NAMES), rng.choice(PLACES)
    return (f"{person} spent the afternoon at {place} reading about {topic}. "
            f"The {rng.choice(ADJECTIVES)} room was full of people, but {person} did not mind. "
            f"By evening {person} had filled three pages of notes and wanted to tell a friend about it.")


def _task(rng: random.Random) -> str:
    t, p, n = rng.choice(TOPICS), rng.choice(PEOPLE), rng.choice(NAMES)
    a, b = rng.sample(TOPICS, 2)
    x, y = rng.randint(2, 40), rng.randint(2, 30)
    kinds = [
        lambda: f"Explain {t} {_length(rng)}.",
        lambda: f"Explain {t} to {p} {_length(rng)}.",
        lambda: f"What is {t}? Answer {_length(rng)}.",
        lambda: f"List {rng.randint(3, 5)} interesting facts about {t}.",
        lambda: f"Give {rng.randint(2, 4)} tips for {p} who wants to learn about {t}.",
        lambda: f"Compare {a} and {b} {_length(rng)}.",
        lambda: f"How does {t} work? Answer {_length(rng)}.",
        lambda: f"Why is {t} important? Answer {_length(rng)}.",
        lambda: f"Define {t} in simple words.",
        lambda: f"Write a haiku about {rng.choice(PLACES)}.",
        lambda: f"Write a two-sentence description of {n}'s visit to {rng.choice(PLACES)}.",
        lambda: f"Write a short email to {n} inviting them to a talk about {t}.",
        lambda: f"Write a title for an article about {t}.",
        lambda: f"Summarize this text in one sentence:\n\n{_text(rng)}",
        lambda: f"Rewrite this text in a more formal tone:\n\n{_text(rng)}",
        lambda: f"{n} has {x} {rng.choice(ITEMS)} and buys {y} more. How many does {n} have now? "
                "Answer with the number, then one sentence.",
        lambda: f"A box holds {y} {rng.choice(ITEMS)}. How many are in {x} boxes? Show the steps.",
        lambda: f"What is {x} times {y}? Answer with the number and one sentence.",
        lambda: f"Write a Python function that {rng.choice(PY_TASKS)}.",
        lambda: f"Write a Python function that {rng.choice(PY_TASKS)}, with a docstring and one example.",
        lambda: f"Is {t} mostly about science, history, health or everyday life? Answer in one word, then "
                "explain briefly.",
        lambda: f"Translate \"{rng.choice(PHRASES)}\" into {rng.choice(LANGUAGES)}.",
        lambda: f"What are the pros and cons of {t}? Answer {_length(rng)}.",
        lambda: f"Describe {rng.choice(PLACES)} on a {rng.choice(ADJECTIVES)} day {_length(rng)}.",
        lambda: f"Suggest three names for a {rng.choice(ADJECTIVES)} cafe.",
        lambda: f"What should {p} know before starting with {t}? Answer {_length(rng)}.",
    ]
    return rng.choice(kinds)()


def instruction_conversations(n: int, seed: int = TRAIN_SEED) -> list[list[dict[str, str]]]:
    """`n` single-turn chats (a user prompt, no reply: regen writes it) drawn from `seed`."""
    rng = random.Random(seed)
    return [[{"role": "user", "content": _task(rng)}] for _ in range(n)]


def eval_instructions(n: int = 32, seed: int = EVAL_SEED) -> list[list[dict[str, str]]]:
    """The held-out prompts: drawn from their own seed, minus any prompt the training seed's first
    HELD_OUT_GUARD rows ask verbatim (a short task can come out twice)."""
    trained = {c[0]["content"] for c in instruction_conversations(HELD_OUT_GUARD)}
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        prompt = _task(rng)
        if prompt not in trained and prompt not in seen:
            seen.add(prompt)
            out.append([{"role": "user", "content": prompt}])
    return out
