"""prepare's fast path gives transformers' own answer, to the character and the token.

`chat.render` calls the compiled template itself (remembering the sandbox's verdicts) and
`PieceEncoder` encodes text shared by a conversation's prefix renders once; both must equal
`apply_chat_template` / `tokenizer(text)`, and prepare's rows must equal the plain per-prefix
rule (tests/prefix_reference.py) on any conversation, thinking on or off, both templates.
"""

from __future__ import annotations

import pytest
from chat_templates import QWEN3_TEMPLATE
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError
from prefix_reference import reference_rows

from dspark_kit.data.chat import render
from dspark_kit.data.conversations import ConversationError, normalize
from dspark_kit.data.piece_encoder import PieceEncoder
from dspark_kit.data.template_rows import tokenize_conversation

pytestmark = pytest.mark.slow  # loads the tiny verifier's tokenizer

# what a template can ask of a message besides its text: keys that are dict methods, missing
# keys (undefined, not None), str methods, the sandbox's verdict on a mutating method
EDGES_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.reasoning_content is defined }}"
    "|{{ m.reasoning_content is none }}|{{ m.get('reasoning_content', 'none given') }}|{{ m['get'] is defined }}"
    "|{{ m.items()|list|length }}|{{ m.content.upper().split('<')|length }}|{{ m.missing|default('dflt') }}"
    "|{{ loop.last }}{% endfor %}{% if add_generation_prompt %}GEN{{ eos_token }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>", "<|MASK|>"]
# text with the pieces templates and tokenizers treat specially: added tokens, halves of them,
# newlines and spaces at the edges, keys a dict has as attributes
fragments = st.sampled_from([*SPECIALS, "<|im_", "think>", "</", "\n", "\n\n", " ", "  ", "a", "Bananas are yellow.",
                             "items", "get", "é", "数", "1, 2, 3", "<tool_response>", "\t"])
text = st.lists(fragments, max_size=12).map("".join)


@pytest.fixture(scope="module")
def tok(qwen3_or_tiny_tok):
    return qwen3_or_tiny_tok


@pytest.fixture(scope="module", params=["tiny", "qwen3", "edges"])
def any_template(request, tiny_verifier):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_verifier)
    t.chat_template = {"tiny": t.chat_template, "qwen3": QWEN3_TEMPLATE, "edges": EDGES_TEMPLATE}[request.param]
    return t


@pytest.fixture(scope="module")
def tiny_tok(tiny_verifier):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_verifier)


@st.composite
def conversations(draw):
    msgs = [{"role": "system", "content": draw(text)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(text)})
        reply = {"role": "assistant", "content": draw(text)}
        if draw(st.booleans()):
            reply["reasoning_content"] = draw(text)
        msgs.append(reply)
    if draw(st.booleans()):
        msgs.append({"role": "user", "content": draw(text), "get": "a key named like a dict method"})
    return msgs


@settings(max_examples=40, deadline=None)
@given(msgs=conversations(), thinking=st.booleans(), gen=st.booleans(), cut=st.integers(1, 10))
def test_render_is_apply_chat_template(any_template, msgs, thinking, gen, cut):
    tok, msgs = any_template, msgs[:cut]
    want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, enable_thinking=thinking)
    assert render(tok, msgs, thinking, add_generation_prompt=gen) == want


@pytest.mark.parametrize("source", ["{{ messages[0].pop('role') }}", "[{{ messages[0].__class__ }}]",
                                    "[{{ messages[0].content.__class__.__mro__ }}]", "{{ messages.append(1) }}"])
def test_render_keeps_the_sandbox(tiny_tok, source):
    def outcome(fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the kind of refusal is what we compare
            return type(e)

    tiny_tok.chat_template, msgs = source, [{"role": "user", "content": "hi"}]
    theirs = outcome(lambda: tiny_tok.apply_chat_template(msgs, tokenize=False))
    assert theirs in (SecurityError, "[]")  # refused, or nothing to show
    assert outcome(lambda: render(tiny_tok, msgs, False)) == theirs


@settings(max_examples=80, deadline=None)
@given(texts=st.lists(text, min_size=1, max_size=8))
def test_piece_encoder_is_the_tokenizer(tiny_tok, texts):
    tok = tiny_tok
    enc = PieceEncoder(tok)
    assert enc.split is not None  # the tiny tokenizer's added tokens allow cutting
    enc.checked = True  # no safety net: the cut itself must be right
    assert enc(texts) == [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]


def test_piece_encoder_falls_back_when_its_cut_disagrees_with_the_tokenizer(tiny_tok):
    tok = tiny_tok
    enc = PieceEncoder(tok)
    enc.split = lambda t: [t[:3], "<|im_end|>", t[3:]]  # a wrong cut: an added token that is not there
    texts = ["hello world", "<|im_start|>user\nhi<|im_end|>\n"]
    want = [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]
    assert enc(texts) == want and enc.split is None
    assert enc(texts) == want


def test_piece_encoder_matches_the_longest_added_token(tiny_verifier):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_verifier)
    t.add_tokens([AddedToken("<a>", normalized=False), AddedToken("<a>b", normalized=False)])
    enc = PieceEncoder(t)
    enc.checked = True
    texts = ["x<a>bc", "<a><a>b<a>", "<a"]
    assert enc(texts) == [list(x) for x in t(texts, add_special_tokens=False)["input_ids"]]


def test_piece_encoder_encodes_whole_texts_for_tokens_that_strip_whitespace(tiny_verifier):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_verifier)
    t.add_tokens([AddedToken("<x>", lstrip=True)])
    enc = PieceEncoder(t)
    assert enc.split is None  # its own rule for whitespace: not ours to copy
    texts = ["a <x> b", "<|im_start|> <x>\n"]
    assert enc(texts) == [list(x) for x in t(texts, add_special_tokens=False)["input_ids"]]


@settings(max_examples=40, deadline=None)
@given(msgs=conversations(), thinking=st.booleans())
def test_prepare_rows_are_the_per_prefix_rule(tok, msgs, thinking):
    try:
        norm = normalize({"messages": msgs})
        ours, _ = tokenize_conversation(tok, norm, thinking, keep_truncated=True)
    except ConversationError:
        return  # rejected rows are covered by test_prepare / test_data_fidelity
    assert ours == reference_rows(tok, norm, thinking)
