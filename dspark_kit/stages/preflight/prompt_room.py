"""Preflight's look at the requests regen will send: each prompt plus regen.max_tokens must fit
serve.max_model_len, or the server refuses it (a 400)."""

from __future__ import annotations

from pathlib import Path

from dspark_kit.findings import Finding
from dspark_kit.resolved import Resolved
from dspark_kit.specdec.verifier_facts import has_tokenizer_files, plan_tokenizer

ROOM_ROWS = 200  # rows of a local data source preflight renders to find regen's longest prompt


def prompt_room(res: Resolved) -> list[Finding]:
    """regen.max_tokens plus the longest prompt regen will send fits serve.max_model_len, measured on
    the first ROOM_ROWS rows of a local or builtin data.source with the verifier's own chat template
    (a hub dataset is not fetched here). A row past it is a 400: an error once those rows exceed
    regen's failure budget (regen.max_failed_fraction), else a warning."""
    r = res.recipe
    limit, source = r.serve.max_model_len, r.data.source
    if limit is None or not r.regen.enabled or r.regen.max_tokens >= limit:  # check_lengths said it
        return []
    if not (source.startswith("builtin:") or Path(source).is_file()) or not Path(res.verifier_path).is_dir():
        return []
    if not has_tokenizer_files(Path(res.verifier_path)):
        return []
    from dspark_kit.data.chat import render
    from dspark_kit.data.sources import SourceError, iter_source

    try:
        tok = plan_tokenizer(res.verifier_path, trust_remote_code=r.verifier.trust_remote_code)
        rows = list(iter_source(r.data, limit=ROOM_ROWS))
    except (OSError, ValueError, TypeError, SourceError):
        return []  # check_mask / the data checks name what does not load
    lengths = []
    for idx, msgs in rows:  # regen's longest request of a row: the history before its last assistant turn
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=len(msgs))
        try:
            text = render(tok, msgs[:last], r.row_thinking(idx), add_generation_prompt=True)
        except Exception:  # noqa: BLE001, S112 - a template that refuses a row: prepare reports it, not this check
            continue
        lengths.append(len(tok(text, add_special_tokens=False)["input_ids"]))
    over = [n for n in lengths if n + r.regen.max_tokens > limit]
    if not over:
        return []
    share = len(over) / len(lengths)
    level = "error" if share > r.regen.max_failed_fraction else "warning"
    return [Finding(level, "prompt-room", (
        f"{len(over)} of the first {len(lengths)} rows of data.source have a prompt of up to {max(over)} tokens: "
        f"with regen.max_tokens {r.regen.max_tokens} that passes serve.max_model_len {limit}, and the server refuses "
        f"each (a 400; {share:.0%} of rows against regen.max_failed_fraction {r.regen.max_failed_fraction}); raise "
        f"serve.max_model_len to {max(over) + r.regen.max_tokens} or lower regen.max_tokens"))]
