"""prepare trains the verifier's own token ids of a reply when regen kept them (`token_ids`, the
server's return_token_ids), and counts the replies whose re-tokenized text would have differed."""

import json

import pytest

from dspark_kit.data.conversations import ConversationError, normalize, to_sharegpt
from dspark_kit.data.template_rows import rows_from_ids, turn_rows
from dspark_kit.engines.chat_client import MalformedResponse, parse_chat_response
from dspark_kit.stages.dataset.prepare import prepare


@pytest.fixture(scope="module")
def tok(tiny_verifier):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_verifier)


def conversation(tok, reply: str, ids: list[int] | None) -> list[dict]:
    turn = {"from": "gpt", "value": reply, **({"token_ids": ids} if ids is not None else {})}
    return normalize({"conversations": [{"from": "human", "value": "Describe the heavy spoon."}, turn]})


def split_ids(tok, text: str) -> list[int]:
    """Another tokenization of `text`: the canonical one with its first multi-character token split."""
    canon = tok(text, add_special_tokens=False)["input_ids"]
    for k, t in enumerate(canon):
        piece = tok.convert_ids_to_tokens(t)
        if len(piece) > 1 and all(tok.convert_tokens_to_ids(c) != tok.unk_token_id for c in piece):
            alt = canon[:k] + [tok.convert_tokens_to_ids(c) for c in piece] + canon[k + 1:]
            assert tok.decode(alt) == tok.decode(canon) and alt != canon
            return alt
    pytest.skip("no splittable token in the text")


@pytest.mark.slow  # the tiny verifier's tokenizer
def test_same_ids_change_nothing(tok):
    reply = "The spoon is very heavy."
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    plain = turn_rows(tok, conversation(tok, reply, None), thinking=False)
    same = turn_rows(tok, conversation(tok, reply, tok(reply, add_special_tokens=False)["input_ids"] + [eot]),
                     thinking=False)
    assert same.rows == plain.rows and same.differs == 0 and not same.fanned


@pytest.mark.slow  # the tiny verifier's tokenizer
def test_differing_ids_are_trained_as_generated(tok):
    reply = "The spoon is very heavy."
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    generated = split_ids(tok, reply) + [eot]
    t = turn_rows(tok, conversation(tok, reply, generated), thinking=False)
    assert t.differs == 1 and len(t.rows) == 1
    ids, mask = t.rows[0]
    assert [i for i, m in zip(ids, mask) if m] == generated  # exactly the verifier's tokens
    plain = turn_rows(tok, conversation(tok, reply, None), thinking=False)
    assert ids[: mask.index(1)] == plain.rows[0][0][: plain.rows[0][1].index(1)]  # the same context


def test_one_differing_turn_fans_the_conversation_out():
    """Turn 0 is also turn 1's history (re-rendered from text): one row cannot be both."""
    p0, u0 = [1, 2], [1, 2, 7, 8, 9]
    p1, u1 = [1, 2, 7, 8, 9, 3], [1, 2, 7, 8, 9, 3, 5, 9]
    t = rows_from_ids([p0, u0, p1, u1], generated=[[7, 6, 6, 9], None])
    assert t.fanned and t.differs == 1
    assert t.rows == [([1, 2, 7, 6, 6, 9], [0, 0, 1, 1, 1, 1]), ([1, 2, 7, 8, 9, 3, 5, 9], [0] * 6 + [1, 1])]
    assert rows_from_ids([p0, u0, p1, u1], generated=[[7, 8, 9], [5, 9]]).rows == [(u1, [0, 0, 1, 1, 1, 0, 1, 1])]


def test_token_ids_round_trip_and_bad_ones_are_refused():
    msgs = normalize({"conversations": [{"from": "human", "value": "hi"},
                                        {"from": "gpt", "value": "yo", "token_ids": [5, 6, 2]}]})
    assert msgs[1]["token_ids"] == [5, 6, 2] and to_sharegpt(msgs)[1]["token_ids"] == [5, 6, 2]
    for bad in ("5 6", [5, -1], [5, "6"], [True]):
        with pytest.raises(ConversationError, match="token_ids must be a list of token ids"):
            normalize({"conversations": [{"from": "human", "value": "hi"},
                                         {"from": "gpt", "value": "yo", "token_ids": bad}]})


def test_chat_response_token_ids():
    body = {"choices": [{"message": {"content": "yo"}, "finish_reason": "stop", "token_ids": [5, 6, 2]}],
            "usage": {"completion_tokens": 3}}
    assert parse_chat_response(body)["token_ids"] == [5, 6, 2]
    assert parse_chat_response({**body, "choices": [{"message": {"content": "yo"}}]})["token_ids"] is None
    with pytest.raises(MalformedResponse, match="token_ids"):
        parse_chat_response({**body, "choices": [{"message": {"content": "yo"}, "token_ids": "5 6"}]})


@pytest.mark.slow  # the tiny verifier's tokenizer
def test_summary_counts_replies_with_ids(tok, tmp_path, tiny_verifier):
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    reply = "The spoon is very heavy."
    rows = [json.loads(json.dumps({"conversations": to_sharegpt(conversation(tok, reply, ids))}))
            for ids in (tok(reply, add_special_tokens=False)["input_ids"] + [eot], split_ids(tok, reply) + [eot], None)]
    s = prepare(rows, str(tiny_verifier), tmp_path / "prepared", seq_length=256, thinking=False)
    assert (s.turns_with_ids, s.retokenized_differs, s.rows_out) == (2, 1, 3)
    assert s.as_dict()["retokenized_differs"] == 1
