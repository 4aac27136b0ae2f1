"""preflight refuses a mask token the verifier's own regenerated replies contain (data/mask_emitted.py)."""

from __future__ import annotations

import json

from dspark_kit.data.mask_emitted import refusal, replies_emitting


class Tok:
    def __len__(self):
        return 100

    def convert_ids_to_tokens(self, i):
        return f"<|reserved_{i}|>"


def _write(path, replies):
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", **r}]} for r in replies]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")


def test_a_reply_with_the_mask_id_is_counted_by_id_else_by_text(tmp_path):
    f = tmp_path / "regen.jsonl"
    _write(f, [{"value": "a", "token_ids": [1, 2, 7]}, {"value": "<|reserved_7|> b"},  # no ids: by its text
               {"value": "<|reserved_7|>", "token_ids": [1, 2]},  # ids win over the decoded text
               {"value": "c", "token_ids": [3]}])
    assert replies_emitting(f, 7, "<|reserved_7|>") == (2, 4)
    line = refusal(f, 7, Tok())
    assert line.startswith("draft.mask_token_id 7 ('<|reserved_7|>') is in 2 of 4 replies") and "regen.jsonl" in line


def test_no_regen_file_or_no_hit_is_no_refusal(tmp_path):
    assert refusal(tmp_path / "regen.jsonl", 7, Tok()) is None
    _write(tmp_path / "regen.jsonl", [{"value": "a", "token_ids": [1]}])
    assert refusal(tmp_path / "regen.jsonl", 7, Tok()) is None
