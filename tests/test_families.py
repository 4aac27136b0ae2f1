"""Each tiny verifier family's chat format (data/families.py), checked token by token against
transformers' own `apply_chat_template`: the rows prepare trains are the template's render, and the
loss mask covers exactly each assistant reply's content plus its end-of-turn token.

Tokenizer-only (the family's tokenizer is built from the corpus in under a second): no model loads."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import yaml

from dspark_kit.data import families as F
from dspark_kit.data.chat import encode
from dspark_kit.data.conversations import normalize
from dspark_kit.data.reasoning_formats import HARMONY, NONE, THINK
from dspark_kit.data.template_rows import tokenize_conversation
from dspark_kit.data.tiny_builder import DEFAULT_SPEC, build_tokenizer
from dspark_kit.specdec.verifier_facts import mask_token_choice, reserved_specials

ROOT = Path(__file__).resolve().parent.parent
USER1, REPLY1 = "count to three", "one two three"
USER2, REPLY2 = "now the animals", "a cat and a dog"
SYSTEM = "You answer briefly."


@functools.cache
def tok(name: str):
    return build_tokenizer(DEFAULT_SPEC, F.FAMILIES[name])


def chat(system: bool, turns: int, reasoning: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}] if system else []
    msgs += [{"role": "user", "content": USER1}, {"role": "assistant", "content": REPLY1}]
    if turns > 1:
        msgs += [{"role": "user", "content": USER2}, {"role": "assistant", "content": REPLY2}]
    if reasoning is not None:
        msgs[-1] = {**msgs[-1], "reasoning_content": reasoning}
    return msgs


CASES = [(False, 1, None), (True, 1, None), (False, 2, None), (True, 2, None)]
THINK_CASES = [(False, 1, "first count, then stop"), (True, 2, "the animals are a cat and a dog")]


def _runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """(start, ids) of each contiguous masked run."""
    out: list[tuple[int, list[int]]] = []
    for i, (t, m) in enumerate(zip(ids, mask, strict=True)):
        if m and out and out[-1][0] + len(out[-1][1]) == i:
            out[-1][1].append(t)
        elif m:
            out.append((i, [t]))
    return out


def _expected_reply(family: F.Family, msg: dict, last: bool, thinking: bool) -> str:
    """The text the verifier generates for an assistant reply (before end of turn): in thinking mode
    the think block is the model's; with thinking off the template pre-fills an empty one (prompt).
    Harmony: the reply opens its channel after the assistant header; reasoning is the analysis
    channel, then the assistant header again and the final channel."""
    if family.reasoning is THINK and last and thinking:
        return f"<think>\n{msg.get('reasoning_content', '')}\n</think>\n\n{msg['content']}"
    if family.reasoning is HARMONY:
        final = f"<|channel|>final<|message|>{msg['content']}"
        if last and msg.get("reasoning_content"):
            return f"<|channel|>analysis<|message|>{msg['reasoning_content']}<|end|><|start|>assistant{final}"
        return final
    return msg["content"]


@pytest.mark.parametrize("name", sorted(F.FAMILIES))
@pytest.mark.parametrize("system,turns,reasoning", CASES + THINK_CASES)
def test_rows_are_the_templates_render_and_the_mask_is_exactly_the_replies(name, system, turns, reasoning):
    family, t = F.FAMILIES[name], tok(name)
    if reasoning is not None and family.reasoning is NONE:
        pytest.skip(f"{name} has no reasoning format")
    thinking = reasoning is not None
    msgs = chat(system, turns, reasoning)
    rows, fanned = tokenize_conversation(t, normalize({"conversations": msgs}), thinking)
    assistants = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
    # one row for the whole conversation, or (history renders differently) one per assistant turn
    ends = [assistants[-1]] if not fanned else assistants
    assert len(rows) == len(ends)
    eot = t.convert_tokens_to_ids(family.end_of_turn)
    for (ids, mask), end in zip(rows, ends, strict=True):
        rendered = t.apply_chat_template(msgs[: end + 1], tokenize=False, enable_thinking=thinking)
        whole = encode(t, rendered)
        assert ids == whole[: len(ids)] and all(not m for m in mask[len(ids):])
        assert len(whole) - len(ids) <= 1  # at most the template's blank after the end-of-turn token
        trained = [j for j in assistants if j <= end] if not fanned else [end]
        runs = _runs(ids, mask)
        assert len(runs) == len(trained), (runs, trained)
        for (start, run), j in zip(runs, trained, strict=True):
            want = encode(t, _expected_reply(family, msgs[j], j == end, thinking)) + [eot]
            assert run == want, (t.convert_ids_to_tokens(run), t.convert_ids_to_tokens(want))
            # right after the generation prompt of the conversation before it (the assistant header)
            asked = t.apply_chat_template(msgs[:j], tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
            assert ids[:start] == encode(t, asked)


@pytest.mark.parametrize("name", sorted(F.FAMILIES))
def test_the_generation_prompt_is_the_assistant_prefix(name):
    family, t = F.FAMILIES[name], tok(name)
    msgs = chat(True, 1)[:2]
    rendered = t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                     enable_thinking=family.reasoning is not NONE)
    assert rendered.endswith(family.assistant_prefix)
    if family.bos:
        ids = encode(t, rendered)
        assert ids[0] == t.bos_token_id and ids.count(t.bos_token_id) == 1  # BOS once, written by the template
        assert t("hello")["input_ids"][0] == t.bos_token_id  # a plain encode adds it, as Llama-3's does


def test_llama3_has_no_spare_row_and_its_mask_is_a_reserved_token_the_template_never_writes():
    family, t = F.LLAMA3, tok("llama3")
    assert family.embedding_rows(len(t)) == len(t) and t.mask_token_id is None
    reserved = reserved_specials(t, t.chat_template)
    assert reserved[0][1] == "<|reserved_special_token_0|>" and reserved[0][1] not in t.chat_template
    mask, why = mask_token_choice(len(t), len(t), None, reserved)
    assert mask == t.convert_tokens_to_ids(family.reserved_mask) and "reserved special token" in why
    recipe = yaml.safe_load((ROOT / "recipes/tiny-llama3-cpu.yaml").read_text())
    assert recipe["draft"]["mask_token_id"] == mask and recipe["draft"]["arch"] == family.draft_arch


def test_gpt_oss_has_harmonys_real_ids_no_spare_row_and_a_reserved_mask_the_template_never_writes():
    """vLLM renders gpt-oss chats in Harmony itself: the tokenizer must give Harmony's own ids, for
    the special tokens and for text alike (the tiny corpus, as the Harmony encoding encodes it)."""
    import random

    from dspark_kit.data.tiny_corpus import conversations, sentence
    from dspark_kit.data.tiny_harmony import VOCAB, harmony_encoding

    family, t = F.GPT_OSS, tok("gpt-oss")
    assert len(t) == VOCAB and family.embedding_rows(len(t)) == VOCAB and t.mask_token_id is None
    enc = harmony_encoding()
    for name in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|reserved_200000|>"):
        assert t.convert_tokens_to_ids(name) == enc.encode(name, allowed_special="all")[0], name
    rng = random.Random(0)
    texts = [m["content"] for c in conversations(300, seed=5) for m in c] + [sentence(rng) for _ in range(50)]
    texts += ["Hello,   world!\n\n\tIt's 12345 -- naïve café 日本語 I'LL  \r\n x/y//z"]
    assert [encode(t, x) for x in texts] == [enc.encode(x) for x in texts]
    reserved = reserved_specials(t, t.chat_template)
    assert reserved[0][1] == family.reserved_mask and reserved[0][1] not in t.chat_template
    mask, why = mask_token_choice(len(t), len(t), None, reserved)
    assert mask == t.convert_tokens_to_ids(family.reserved_mask) == 200000 and "reserved special token" in why
    recipe = yaml.safe_load((ROOT / "recipes/tiny-gpt-oss-cpu.yaml").read_text())
    assert recipe["draft"]["mask_token_id"] == mask


def test_qwen_families_keep_the_spare_row_rule():
    for name in ("qwen3", "qwen3-moe"):
        t, family = tok(name), F.FAMILIES[name]
        rows = family.embedding_rows(len(t))
        assert rows > len(t) and mask_token_choice(rows, len(t), (t.mask_token_id, t.mask_token))[0] == len(t)


@pytest.mark.parametrize("name", sorted(F.FAMILIES))
def test_each_family_has_its_recipe(name):
    path = ROOT / ("recipes/tiny-cpu.yaml" if name == "qwen3" else f"recipes/tiny-{name}-cpu.yaml")
    recipe = yaml.safe_load(path.read_text())
    assert recipe["verifier"]["path"] == F.FAMILIES[name].builtin
    assert recipe["draft"]["arch"] == F.FAMILIES[name].draft_arch


@pytest.mark.slow  # reads the shipped tiny Llama-3 verifier
def test_preflight_names_the_mask_token_to_set_when_none_is_and_no_row_is_spare(tmp_path, tiny_verifier):
    """A full vocabulary with draft.mask_token_id unset: preflight's error names the id init's rule
    picks and why (Llama-3's first reserved token), not just "a reserved special id"."""
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.preflight.checks import run_preflight

    recipe = load_recipe(ROOT / "recipes" / "tiny-llama3-cpu.yaml",
                         ["draft.mask_token_id=null", f"workdir={tmp_path / 'run'}"])
    [found] = [f for f in run_preflight(Resolved(recipe), probes=False) if f.code == "pitfall-7"]
    want = load_recipe(ROOT / "recipes" / "tiny-llama3-cpu.yaml").draft.mask_token_id  # what init wrote there
    assert found.level == "error" and f"set draft.mask_token_id: {want}, " in found.message, found.message
    assert "<|reserved_special_token_0|>" in found.message and "\n" not in found.message
