"""Chat datasets for regen: builtin corpus, local files, HF presets.

`iter_source(data_cfg)` yields `(idx, messages)` where idx is the row's
position in the source, so it is stable across runs and `regen --resume` can
skip finished rows by idx. A row that cannot be normalised is counted under its
reason in `skipped` and the run goes on: one bad row must not stop 200k.
`formats` counts the rows read per format (conversations.FORMATS: OpenAI messages,
with `tools` / `tool_calls` / `tool` turns; ShareGPT, with `function_call` /
`observation` turns; prompt/response), so a run can say what it read.
`iter_rows` gives the rows themselves (a preset's mapped onto a readable schema), for a
reader that keeps what `messages` alone drops (the row's `tools`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dspark_kit.data.conversations import ConversationError, normalize, row_format, row_tools
from dspark_kit.recipe import DataCfg

TINY_CHAT = "builtin:tiny-chat"
TINY_CHAT_ROWS = 512
TINY_TOOLS = "builtin:tiny-tools"  # tool-calling chats over the same words (data/tiny_tools.py)
INSTRUCTIONS = "builtin:instructions"  # varied prompts for a real instruct model (data/instructions.py)

# name -> (hub id, subset, default split)
PRESETS: dict[str, tuple[str, str | None, str]] = {
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", None, "train_sft"),
    "magpie": ("Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered", None, "train"),
    "gsm8k": ("openai/gsm8k", "main", "train"),
}


class SourceError(ValueError):
    """The source itself is unusable (missing file, unknown preset)."""


def preset_row(preset: str, row: dict[str, Any]) -> dict[str, Any]:
    """Map a preset's row schema onto one `conversations.normalize` accepts."""
    if preset == "gsm8k":  # the answer is replaced by the verifier's own
        question = row.get("question") if isinstance(row, dict) else None
        if not isinstance(question, str) or not question.strip():
            raise ConversationError("gsm8k row without a 'question' text")
        return {"messages": [{"role": "user", "content": question}]}
    return row  # ultrachat: messages[{role, content}]; magpie: conversations[{from, value}]


def _jsonl_rows(path: Path, skipped: Counter) -> Iterator[Any]:
    from dspark_kit.jsonl import BadLine, read_jsonl

    for row in read_jsonl(path):
        if isinstance(row, BadLine):
            skipped[row.reason] += 1
            yield None  # keeps idx aligned with the line number of valid rows' neighbours
        else:
            yield row


def _file_rows(path: Path, skipped: Counter) -> Iterable[Any]:
    if not path.exists():
        raise SourceError(f"data.source {path}: file not found (a jsonl/json/parquet path, "
                          f"{TINY_CHAT} or one of {', '.join(PRESETS)})")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        from datasets import load_dataset

        return load_dataset("parquet", data_files=str(path), split="train")
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            return _jsonl_rows(path, skipped)  # a .json file that is really jsonl
        if isinstance(data, dict):  # {"data": [...]} style wrappers
            data = next((v for v in data.values() if isinstance(v, list)), [data])
        return data
    if suffix in (".jsonl", ".ndjson"):
        return _jsonl_rows(path, skipped)
    raise SourceError(f"data.source {path}: unsupported extension {suffix!r} (use .jsonl, .json or .parquet)")


def _preset_rows(name: str, cfg: DataCfg) -> Iterable[Any]:
    from datasets import load_dataset

    hub_id, subset, split = PRESETS[name]
    return load_dataset(hub_id, cfg.subset or subset, split=cfg.split or split)


def source_rows(cfg: DataCfg, seed: int, skipped: Counter) -> tuple[str | None, Iterable[Any]]:
    """(preset name or None, raw rows) for a data section."""
    src = cfg.source
    if src == TINY_CHAT:
        from dspark_kit.data.tiny_corpus import conversations

        n = cfg.limit or TINY_CHAT_ROWS
        return None, ({"messages": m} for m in conversations(n, seed=seed))
    if src == TINY_TOOLS:
        from dspark_kit.data.tiny_tools import tool_conversations

        return None, iter(tool_conversations(cfg.limit or TINY_CHAT_ROWS, seed=seed))
    if src == INSTRUCTIONS:
        from dspark_kit.data.instructions import instruction_conversations

        return None, ({"messages": m} for m in instruction_conversations(cfg.limit or TINY_CHAT_ROWS, seed=seed))
    if src in PRESETS:
        return src, _preset_rows(src, cfg)
    if src.startswith("builtin:"):
        raise SourceError(f"data.source {src!r}: unknown builtin (only {TINY_CHAT}, {TINY_TOOLS} and {INSTRUCTIONS})")
    return None, _file_rows(Path(src).expanduser(), skipped)


def source_size(cfg: DataCfg) -> int | None:
    """How many rows iter_source reads at most, when that is cheap to know (the builtin corpus,
    a jsonl file's lines), for a progress bar; None otherwise."""
    src, n = cfg.source, None
    if src in (TINY_CHAT, TINY_TOOLS, INSTRUCTIONS):
        n = cfg.limit or TINY_CHAT_ROWS
    elif not src.startswith("builtin:") and src not in PRESETS:
        path = Path(src).expanduser()
        if path.suffix.lower() in (".jsonl", ".ndjson") and path.is_file():
            with path.open("rb") as f:
                n = sum(1 for line in f if line.strip())
    return min(n, cfg.limit) if n is not None and cfg.limit else n


def iter_rows(
    cfg: DataCfg,
    skipped: Counter | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> Iterator[tuple[int, Any]]:
    """(idx, row) for each row read, at most `limit` (or data.limit); rows the file reader could not
    parse are counted in `skipped`, a preset row that does not map is counted there too."""
    skipped = skipped if skipped is not None else Counter()
    limit = limit or cfg.limit
    preset, rows = source_rows(cfg, seed, skipped)
    for idx, row in enumerate(rows):
        if limit is not None and idx >= limit:
            return
        if row is None:  # already counted by the reader
            continue
        try:
            yield idx, preset_row(preset, row) if preset else row
        except ConversationError as e:
            skipped[str(e)] += 1


def iter_chats(
    cfg: DataCfg,
    skipped: Counter | None = None,
    limit: int | None = None,
    seed: int = 0,
    formats: Counter | None = None,
) -> Iterator[tuple[int, list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """(idx, messages, tools or None) for each usable row, at most `limit` (or data.limit) rows read."""
    skipped = skipped if skipped is not None else Counter()
    for idx, row in iter_rows(cfg, skipped, limit, seed):
        if formats is not None:
            formats[row_format(row) or "unknown"] += 1
        try:
            yield idx, normalize(row), row_tools(row)
        except ConversationError as e:
            skipped[str(e)] += 1


def iter_source(
    cfg: DataCfg,
    skipped: Counter | None = None,
    limit: int | None = None,
    seed: int = 0,
    formats: Counter | None = None,
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(idx, messages) for each usable row (iter_chats without the tool schemas)."""
    return ((idx, msgs) for idx, msgs, _ in iter_chats(cfg, skipped, limit, seed, formats))
