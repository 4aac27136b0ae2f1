"""Token lengths of a chat data source, rendered the way prepare renders it: the basis for a new
recipe's data.seq_length (`dspark-kit init --data`)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from dspark_kit.data.chat import encode, render
from dspark_kit.data.sources import iter_source
from dspark_kit.recipe import DataCfg


class DataSampleError(ValueError):
    """The data source cannot be read or has no usable chat; one line naming --data and the fix."""


@dataclass(frozen=True)
class LengthSample:
    rows: int  # rows rendered
    p50: int
    p99: int
    longest: int
    skipped: tuple[tuple[str, int], ...] = ()  # (reason, rows) the sample could not use, most first

    def skipped_note(self) -> str:
        """'; skipped 3 unusable rows (2: not JSON, 1: ...)' or '' (a sample that used every row)."""
        n = sum(k for _, k in self.skipped)
        return f"; skipped {n} unusable row(s) ({', '.join(f'{k}: {r}' for r, k in self.skipped[:3])})" if n else ""


def percentile(values: list[int], q: float) -> int:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def sample_lengths(source: str, tokenizer, thinking: bool, sample: int = 256) -> LengthSample:
    """Token lengths of the first `sample` usable conversations of `source` (whole chats, chat template
    applied in the recipe's thinking mode)."""
    cfg = DataCfg(source=source)
    skipped: Counter = Counter()
    lengths: list[int] = []
    try:
        for _, messages in iter_source(cfg, skipped=skipped, limit=sample):
            try:
                lengths.append(len(encode(tokenizer, render(tokenizer, messages, thinking))))
            except Exception:  # noqa: BLE001 - a row the template rejects is counted, not fatal
                skipped["the chat template rejected it"] += 1
    except ValueError as e:  # SourceError and friends already name data.source
        raise DataSampleError(f"--data {source}: unreadable ({str(e).splitlines()[0]})") from None
    except Exception as e:  # noqa: BLE001 - hub offline, unreadable parquet, permission: one line
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise DataSampleError(f"--data {source}: unreadable ({type(e).__name__}: {reason})") from None
    if not lengths:
        why = "; ".join(f"{n}: {reason}" for reason, n in skipped.most_common(3)) or "no rows"
        raise DataSampleError(f"--data {source}: no usable chat in the first {sample} rows ({why}); expected "
                              "rows with messages [{role, content}] or conversations [{from, value}]")
    return LengthSample(rows=len(lengths), p50=percentile(lengths, 50), p99=percentile(lengths, 99),
                        longest=max(lengths), skipped=tuple(skipped.most_common()))


TRUNCATED_WARN = 0.05  # regen says so when more replies than this were cut at regen.max_tokens


def loops(text: str, window: int = 600, probe: int = 30) -> bool:
    """Whether a reply ends in a loop: its last `probe` characters occur 3+ times in its last `window`
    (a greedy small model repeating a phrase until max_tokens)."""
    tail = text[-window:]
    return len(tail) >= 3 * probe and tail.count(tail[-probe:]) >= 3


def replies_cut(rows) -> tuple[int, int, int]:
    """(replies cut at max_tokens, replies, cut replies that end in a loop) over regen rows: each
    reply's finish_reason as the server gave it (metadata.finish_reasons, one per regenerated reply,
    in the order of the row's assistant turns)."""
    cut = replies = looping = 0
    for row in rows:
        if not isinstance(row, dict):
            continue
        reasons = (row.get("metadata") or {}).get("finish_reasons") or []
        turns = [t for t in row.get("conversations") or [] if isinstance(t, dict) and t.get("from") == "gpt"]
        replies += len(reasons)
        for i, reason in enumerate(reasons):
            if reason == "length":
                cut += 1
                text = turns[i].get("value") if i < len(turns) else None
                looping += isinstance(text, str) and loops(text)
    return cut, replies, looping


def truncation_line(cut: int, replies: int, max_tokens: int, looping: int = 0, kept: bool = False) -> str | None:
    """regen's closing line when more than TRUNCATED_WARN of the replies were cut (None otherwise):
    prepare drops a cut reply's row by default, or, with data.keep_truncated (`kept`), trains it up to
    where the verifier stopped (not the end-of-turn the template adds). Cut replies that end in a loop are counted
    apart: more tokens would not end them."""
    if not replies or cut / replies <= TRUNCATED_WARN:
        return None
    fate = ("prepare keeps their rows (data.keep_truncated: trained up to where the verifier stopped)" if kept
            else "prepare drops their rows")
    line = (f"{cut} of {replies} replies ({cut / replies:.0%}) were cut at regen.max_tokens {max_tokens} "
            f"(finish_reason length), and {fate}")
    if looping:
        line += (f"; {looping} of them end repeating themselves (a greedy loop: more tokens would not end "
                 "those)")
    if cut - looping > TRUNCATED_WARN * replies:
        line += (f"; raise regen.max_tokens (and data.seq_length to hold the replies), e.g. --set "
                 f"regen.max_tokens={max_tokens * 2}")
    else:
        line += "; the rest are few: regen.max_tokens is not what cuts them"
    return line
