"""The embedded corpus: replies are templates filled from the prompt, so they depend on it (issue 13)."""

import random
import re

import pytest

from dspark_kit.data.tiny_corpus import _task, conversations, vocabulary


def _content_words(text: str, known: set[str]) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w in known} | set(re.findall(r"\d+", text))


def test_every_reply_word_from_the_word_list_comes_from_its_prompt():
    """No reply invents a noun/adjective/verb/place: a verifier can only be followed (and a draft
    can only predict it) when the reply is determined by the prompt."""
    known = {w for group in vocabulary().values() for phrase in group for w in phrase.split()}
    # words the templates themselves use ("every day", "the ball", "a title for a book") and
    # the prepositions of places
    known -= {"ball", "book", "day", "the", "in", "at", "on", "by", "near", "under"}
    rng = random.Random(0)
    for _ in range(600):
        prompt, reply, _reasoning = _task(rng)
        words = _content_words(reply, known)
        assert words, (prompt, reply)
        missing = {w for w in words if not w.isdigit()} - _content_words(prompt, known)
        assert not missing, (prompt, reply, missing)


def test_the_reply_changes_with_the_prompt_words():
    """Two tasks of one kind with different words never share a reply."""
    chats = conversations(400, seed=5, max_turns=1)
    by_prompt = {c[0]["content"]: c[1]["content"] for c in chats}
    replies = {}
    for prompt, reply in by_prompt.items():
        replies.setdefault(reply, set()).add(prompt)
    assert all(len(p) == 1 for p in replies.values())


@pytest.mark.slow
def test_the_tiny_verifier_ties_its_embeddings(tiny_verifier):
    """As Qwen3-0.6B does; speculators then takes lm_head from embed_tokens (no lm_head tensor)."""
    import json

    from safetensors import safe_open

    assert json.loads((tiny_verifier / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(tiny_verifier / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not any(k.endswith("lm_head.weight") for k in names)
