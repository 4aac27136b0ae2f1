"""The reasoning formats (data/reasoning_formats.py): each family's markers split a reply as the
family's template wrote it and as its vLLM parser answers, and a verifier's files name its format."""

from __future__ import annotations

import pytest

from dspark_kit.data import families as F
from dspark_kit.data.reasoning_formats import (
    HARMONY,
    NONE,
    PARSERS,
    THINK,
    of_template,
    split_inline,
)
from dspark_kit.engines.local.stream import TextStream

ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"


@pytest.mark.parametrize("text,expected", [
    (f"{ANALYSIS}count up{'<|end|>'}{FINAL}1, 2, 3.", {"reasoning_content": "count up", "content": "1, 2, 3."}),
    (f"{ANALYSIS}cut off", {"reasoning_content": "cut off", "content": None}),
    ("<|channel|>final<|message|>straight", {"reasoning_content": None, "content": "straight"}),
    (f"{ANALYSIS}\nkept\n<|end|>{FINAL}\nas is", {"reasoning_content": "\nkept\n", "content": "\nas is"}),
])
def test_harmony_splits_a_reply_as_vllms_openai_gptoss_parser_answers(text, expected):
    got = PARSERS["openai_gptoss"].split_reply(text)
    assert {k: got[k] for k in expected} == expected and got["reasoning"] == got["reasoning_content"]


@pytest.mark.parametrize("fmt", [THINK, HARMONY])
def test_inline_reasoning_splits_back_into_what_the_template_was_given(fmt):
    """A reply the family's template wrote (a corpus reply, rendered) splits into its reasoning and content."""
    family = next(f for f in F.FAMILIES.values() if f.reasoning is fmt)
    msg = fmt.corpus_reply("The fox is red.", "A description of the fox.")
    from jinja2 import Environment

    text = Environment().from_string(family.chat_template).render(
        messages=[{"role": "user", "content": "Describe the red fox."}, msg], add_generation_prompt=False)
    reply = text.split(family.assistant_prefix, 1)[1].removesuffix(family.end_of_turn + "\n").removesuffix(
        family.end_of_turn)
    assert split_inline(reply) == ("A description of the fox.", "The fox is red.", False)


def test_a_reply_without_markers_has_no_reasoning():
    assert split_inline("just a reply") == (None, "just a reply", False)
    assert split_inline("<think>\ncut off") == (None, "<think>\ncut off", True)  # unclosed: kept raw, marked


def test_a_streamed_harmony_reply_holds_back_a_partial_marker_and_ends_as_the_whole_split():
    """Token by token (each special token whole, as the engine decodes), the pieces concatenate to the split."""
    pieces = ["<|channel|>", "analysis", "<|message|>", "count", " up", "<|end|>", "<|start|>", "assistant",
              "<|channel|>", "final", "<|message|>", "1,", " 2."]
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), frozenset(), [], field="content",
                        split=HARMONY.split_reply)
    sent: dict[str, str] = {}
    for i in range(len(pieces)):
        for key, value in stream.push([i]).items():
            sent[key] = sent.get(key, "") + value
            assert "<|" not in value, value  # no marker, nor a piece of one, is ever sent
    assert sent == {"reasoning_content": "count up", "content": "1, 2."}


@pytest.mark.parametrize("name", sorted(F.FAMILIES))
def test_a_verifiers_template_names_its_familys_format(name):
    family = F.FAMILIES[name]
    assert of_template(family.chat_template) is family.reasoning
    assert of_template(None, family.model_type) is (HARMONY if name == "gpt-oss" else NONE)


def test_only_a_format_with_a_switch_has_stray_reasoning():
    assert THINK.stray(True, thinking=False) and not THINK.stray(True, thinking=True)
    assert not HARMONY.stray(True, thinking=False) and not NONE.stray(True, thinking=False)
