"""Whether the verifier's own generations contain a token: the mask token must not be one it emits.

The draft's query block is `[anchor, MASK x (K-1)]`: a mask token the verifier also generates
would be both "unknown, predict me" and a real reply token to the draft. regen keeps each
reply's token ids (`return_token_ids`), so the check reads exactly what the verifier emitted;
a reply without ids is checked by its text.
"""

from __future__ import annotations

from pathlib import Path

from dspark_kit.jsonl import BadLine, read_jsonl


def replies_emitting(path: Path, token_id: int, token_text: str | None, limit: int = 20000) -> tuple[int, int]:
    """(replies that contain the token, replies read) among the first `limit` rows of a regen file."""
    hits = seen = 0
    for n, row in enumerate(read_jsonl(path)):
        if n >= limit:
            break
        if isinstance(row, BadLine) or not isinstance(row, dict):
            continue
        turns = row.get("conversations") or row.get("messages") or []
        for t in turns if isinstance(turns, list) else []:
            if not isinstance(t, dict) or (t.get("role") or t.get("from")) not in ("assistant", "gpt"):
                continue
            seen += 1
            ids, text = t.get("token_ids"), t.get("content") or t.get("value")
            if isinstance(ids, list):
                hits += token_id in ids
            elif token_text and isinstance(text, str):
                hits += token_text in text
    return hits, seen


def refusal(regen_file: Path, mask_id: int, tok) -> str | None:
    """preflight's line when the verifier's regenerated replies contain the mask token, else None."""
    if not regen_file.is_file():
        return None
    text = tok.convert_ids_to_tokens(mask_id) if mask_id < len(tok) else None
    hits, seen = replies_emitting(regen_file, mask_id, text)
    if not hits:
        return None
    return (f"draft.mask_token_id {mask_id} ({text!r}) is in {hits} of {seen} replies the verifier generated "
            f"({regen_file.name}): set it to a reserved special id the verifier never emits")
