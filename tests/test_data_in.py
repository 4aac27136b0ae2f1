"""Data in, nothing changed silently (issue 55): every row read is used, changed or dropped, counted by
reason on the console, and each changed or dropped row is in `<prepared>.errors.jsonl` with the line
it was read from. Invalid UTF-8 is refused per row (unless data.invalid_utf8: replace), a byte-order
mark is stripped, a reply data.seq_length cuts carries no loss (unless data.cut_replies: train),
ShareGPT's top-level `system` is the system turn, TRL rows keep their user turn.

prepare runs for real on the tokenizer fixture (a byte-level BPE with the tiny verifier's chat
template): no model is loaded."""

from __future__ import annotations

import json

import pytest
from data_helpers import chat, prepared_texts, run_prepare, write_lines

from dspark_kit.data.conversations import ConversationError, normalize
from dspark_kit.data.readers import BOM_STRIPPED, INVALID_UTF8, REPLACED_UTF8
from dspark_kit.stages.dataset.prepare import CUT_MASKED, CUT_TRAINED, ONLY_CUT_REPLIES

# ---- invalid UTF-8, byte-order mark --------------------------------------------------------------


def test_invalid_utf8_is_refused_per_row_with_its_line(tmp_path, capsys):
    good = json.dumps(chat("Where is the cafe?", "Round the corner.")).encode()
    bad = json.dumps(chat("Name a dessert.", "XX")).encode().replace(b"XX", b"cr\xe8me br\xfbl\xe9e")  # latin-1
    src = write_lines(tmp_path / "d.jsonl", [good, bad, good])
    s, entries, err = run_prepare(tmp_path, src, capsys)
    assert s["conversations_in"] == 3 and s["conversations_used"] == 2
    assert s["rejected"] == {INVALID_UTF8: 1}
    assert f"skipped 1: {INVALID_UTF8}" in err and "prepared.errors.jsonl" in err
    col = bad.index(b"\xe8") + 1
    assert entries == [{"where": f"{src}:2", "action": "dropped", "reason": INVALID_UTF8,
                        "detail": f"byte 0xe8 at column {col}"}]
    assert not any("\ufffd" in whole for whole, _ in prepared_texts(tmp_path))


def test_invalid_utf8_replaced_when_asked_and_counted(tmp_path, capsys):
    bad = json.dumps(chat("Name a dessert.", "XX")).encode().replace(b"XX", b"cr\xe8me")
    src = write_lines(tmp_path / "d.jsonl", [json.dumps(chat("a?", "b.")).encode(), bad])
    s, entries, err = run_prepare(tmp_path, src, capsys, invalid_utf8="replace")
    assert s["conversations_used"] == 2 and s["changed"] == {REPLACED_UTF8: 1}
    assert f"changed 1: {REPLACED_UTF8}" in err
    assert [(e["where"], e["action"]) for e in entries] == [(f"{src}:2", "changed")]
    assert any("cr\ufffdme" in trained for _, trained in prepared_texts(tmp_path))


def test_a_byte_order_mark_is_stripped_and_the_first_row_kept(tmp_path, capsys):
    src = write_lines(tmp_path / "d.jsonl", [b"\xef\xbb\xbf" + json.dumps(chat("first?", "One.")).encode(),
                                             json.dumps(chat("second?", "Two.")).encode()])
    s, entries, err = run_prepare(tmp_path, src, capsys)
    assert s["conversations_used"] == 2 and not s["rejected"]
    assert s["changed"] == {BOM_STRIPPED: 1} and entries[0]["where"] == f"{src}:1"
    assert f"changed 1: {BOM_STRIPPED}" in err
    assert "first?" in prepared_texts(tmp_path)[0][0]


def test_invalid_utf8_in_a_json_list_is_judged_per_row(tmp_path):
    src = tmp_path / "d.json"
    src.write_bytes(b"[" + json.dumps(chat("ok?", "Yes.")).encode() + b","
                    + json.dumps(chat("bad?", "XX")).encode().replace(b"XX", b"\xff") + b"]")
    s, entries, _ = run_prepare(tmp_path, src)
    assert s["conversations_used"] == 1 and s["rejected"] == {INVALID_UTF8: 1}
    assert entries[0]["where"] == f"{src} row 2"


# ---- replies cut at data.seq_length ------------------------------------------------------------


def test_a_reply_cut_at_seq_length_carries_no_loss_by_default(tmp_path, capsys):
    """Two turns: the first complete within seq_length, the second cut. By default the cut reply is
    masked (the first still trains); a row whose only reply is cut is dropped; both counted."""
    two = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."},
                        {"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(map(str, range(60)))}]}
    one = chat("Count.", " ".join(map(str, range(60))))
    src = write_lines(tmp_path / "d.jsonl", [json.dumps(two).encode(), json.dumps(one).encode()])
    s, entries, err = run_prepare(tmp_path, src, capsys, seq_length=64)
    assert s["conversations_used"] == 1 and s["rejected"] == {ONLY_CUT_REPLIES: 1}
    assert s["changed"] == {CUT_MASKED: 1} and s["cut_replies"] == 2
    assert f"changed 1: {CUT_MASKED}" in err and f"skipped 1: {ONLY_CUT_REPLIES}" in err
    assert {(e["where"], e["action"]) for e in entries} == {(f"{src}:1", "changed"), (f"{src}:2", "dropped")}
    [(_whole, trained)] = prepared_texts(tmp_path)
    assert trained.endswith("Hi.<|im_end|>") and "59" not in trained  # only the complete reply


def test_cut_replies_train_keeps_the_old_way_counted(tmp_path, capsys):
    src = write_lines(tmp_path / "d.jsonl", [json.dumps(chat("Count.", " ".join(map(str, range(60))))).encode()])
    s, _, err = run_prepare(tmp_path, src, capsys, seq_length=64, cut_replies="train")
    assert s["conversations_used"] == 1 and s["changed"] == {CUT_TRAINED: 1}
    assert f"changed 1: {CUT_TRAINED}" in err
    [(_whole, trained)] = prepared_texts(tmp_path)
    assert "<|im_end|>" not in trained


# ---- rows' shapes: ShareGPT's system, TRL, empty user turns ----------------------------------------


def test_sharegpt_top_level_system_is_the_system_turn(tmp_path):
    row = {"system": "You answer in French.", "conversations": [{"from": "human", "value": "Hello?"},
                                                                 {"from": "gpt", "value": "Bonjour."}]}
    assert normalize(row)[0] == {"role": "system", "content": "You answer in French."}
    with pytest.raises(ConversationError, match="system prompt given twice"):
        normalize({**row, "conversations": [{"from": "system", "value": "x"}, *row["conversations"]]})
    src = write_lines(tmp_path / "d.jsonl", [json.dumps(row).encode()])
    s, _, _ = run_prepare(tmp_path, src)
    assert s["conversations_used"] == 1
    [(whole, trained)] = prepared_texts(tmp_path)
    assert "You answer in French." in whole and "French" not in trained


@pytest.mark.parametrize("row", [
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "completion": [{"role": "assistant", "content": "4."}]},
    {"prompt": "What is 2+2?", "completion": "4."},
], ids=["conversational", "plain"])
def test_trl_prompt_completion_keeps_its_user_turn(tmp_path, row):
    """regen reads rows through iter_chats: the user turn is the prompt, never an empty one."""
    from collections import Counter

    from dspark_kit.data.sources import iter_chats
    from dspark_kit.recipe import DataCfg

    src = write_lines(tmp_path / "trl.jsonl", [json.dumps(row).encode()])
    formats: Counter = Counter()
    [(_idx, msgs, _tools)] = list(iter_chats(DataCfg(source=str(src)), formats=formats))
    assert msgs == [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
    assert formats == {"TRL prompt/completion": 1}


def test_a_row_with_an_empty_user_turn_is_refused(tmp_path):
    with pytest.raises(ConversationError, match="turn 0: empty user turn"):
        normalize({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "a"}]})
    # content parts that are not text would otherwise be an empty turn too
    with pytest.raises(ConversationError, match="parts other than text"):
        normalize({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                                {"role": "assistant", "content": "a"}]})


def test_regen_lists_the_source_rows_it_drops_by_line(tmp_path):
    """Rows regen cannot send are counted and go to its errors file with their line."""
    from dspark_kit.data.sources import iter_chats
    from dspark_kit.recipe import DataCfg

    src = write_lines(tmp_path / "d.jsonl", [json.dumps(chat("a?", "b.")).encode(), b"{oops",
                                             json.dumps({"prompt": [{"role": "user", "content": ""}],
                                                         "completion": "x"}).encode()])
    dropped = []
    got = list(iter_chats(DataCfg(source=str(src)), on_drop=lambda *d: dropped.append(d)))
    assert [i for i, *_ in got] == [0]
    assert [(i, w) for i, w, _ in dropped] == [(1, f"{src}:2"), (2, f"{src}:3")]
    assert "empty user turn" in dropped[1][2]
