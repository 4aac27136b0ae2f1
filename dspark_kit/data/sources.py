"""Chat datasets for regen and prepare: builtin corpus, local files, hub datasets (docs/DATA.md).

`iter_source(data_cfg)` yields `(idx, messages)` where idx is the row's
position in the source, so it is stable across runs and `regen --resume` can
skip finished rows by idx. A row that cannot be normalised is counted under its
reason in `skipped` and the run goes on: one bad row must not stop 200k; a row
reading changed (data/readers.py: a byte-order mark stripped, invalid UTF-8 replaced when asked)
is counted under its reason in `changed`.
`formats` counts the rows read per format (conversations.FORMATS: OpenAI messages,
with `tools` / `tool_calls` / `tool` turns; ShareGPT, with `function_call` /
`observation` turns; Alpaca; TRL prompt/completion; prompt/response), so a run can say what it read.
`iter_records` gives each row with where it came from (file:line) and what reading changed, bad
ones included, for a stage that writes an errors file; `iter_rows` gives the rows themselves (a
preset's mapped onto a readable schema), for a reader that keeps what `messages` alone drops (the
row's `tools`).

Names: `builtin:...`, a preset (`ultrachat`, `ultrachat_200k`, `magpie`, `gsm8k`, each with an
optional `:SPLIT`), `hf:NAME[:CONFIG]:SPLIT` (any hub dataset, through `datasets`); anything
else is a local path. A path that exists is always read from disk, whatever it is named.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from dspark_kit.data.conversations import ConversationError, normalize, row_format, row_tools
from dspark_kit.data.readers import Record, SourceError, read_file, read_hub
from dspark_kit.jsonl import BadLine
from dspark_kit.recipe import DataCfg
from dspark_kit.recipe.schema import HUB_PREFIX

__all__ = [
    "PRESETS",
    "TINY_CHAT",
    "TINY_TOOLS",
    "SourceError",
    "iter_chats",
    "iter_records",
    "iter_rows",
    "iter_source",
    "names_hub_dataset",
    "preset_row",
    "source_size",
]

TINY_CHAT = "builtin:tiny-chat"
TINY_CHAT_ROWS = 512
TINY_TOOLS = "builtin:tiny-tools"  # tool-calling chats over the same words (data/tiny_tools.py)
INSTRUCTIONS = "builtin:instructions"  # varied prompts for a real instruct model (data/instructions.py)
CODE = "builtin:code"  # Python tasks for a real instruct model, HumanEval's shape among them (data/code_prompts.py)

# name -> (hub id, subset, default split); `ultrachat_200k` is the hub's own name (the reference
# run's `ultrachat_200k:train_sft`)
PRESETS: dict[str, tuple[str, str | None, str]] = {
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", None, "train_sft"),
    "ultrachat_200k": ("HuggingFaceH4/ultrachat_200k", None, "train_sft"),
    "magpie": ("Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered", None, "train"),
    "gsm8k": ("openai/gsm8k", "main", "train"),
}


def preset_row(preset: str, row: dict[str, Any]) -> dict[str, Any]:
    """Map a preset's row schema onto one `conversations.normalize` accepts."""
    if preset == "gsm8k":  # the answer is replaced by the verifier's own
        question = row.get("question") if isinstance(row, dict) else None
        if not isinstance(question, str) or not question.strip():
            raise ConversationError("gsm8k row without a 'question' text")
        return {"messages": [{"role": "user", "content": question}]}
    return row  # ultrachat: messages[{role, content}]; magpie: conversations[{from, value}]


def hub_source(src: str, cfg: DataCfg) -> tuple[str | None, str, str | None, str] | None:
    """(preset or None, hub id, config, split) when data.source names a hub dataset (a preset, with
    an optional :SPLIT, or hf:NAME[:CONFIG]:SPLIT), else None. data.subset / data.split fill what
    the name leaves out."""
    if src.startswith(HUB_PREFIX):
        parts = src[len(HUB_PREFIX):].split(":")
        if len(parts) > 3 or not all(parts):
            raise SourceError(f"data.source {src!r}: write hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT "
                              "(e.g. hf:HuggingFaceH4/ultrachat_200k:train_sft)")
        name, config, split = parts[0], parts[1] if len(parts) == 3 else None, parts[-1] if len(parts) > 1 else None
        return None, name, config or cfg.subset, split or cfg.split or "train"
    name, _, split = src.partition(":")
    if name in PRESETS:
        hub_id, subset, default_split = PRESETS[name]
        return name, hub_id, cfg.subset or subset, split or cfg.split or default_split
    return None


def names_hub_dataset(cfg: DataCfg) -> bool:
    """Whether data.source is a hub dataset (a preset or hf: name, with no such local path): reading
    it may download, so a plan does not."""
    try:
        return not Path(cfg.source).expanduser().exists() and hub_source(cfg.source, cfg) is not None
    except SourceError:
        return False


def _records(cfg: DataCfg, seed: int) -> tuple[str | None, Iterable[Record]]:
    """(preset name or None, records) for a data section."""
    src = cfg.source
    if src == TINY_CHAT:
        from dspark_kit.data.tiny_corpus import conversations

        n = cfg.limit or TINY_CHAT_ROWS
        return None, (Record(f"{src} row {i + 1}", {"messages": m}) for i, m in enumerate(conversations(n, seed=seed)))
    if src == TINY_TOOLS:
        from dspark_kit.data.tiny_tools import tool_conversations

        rows = tool_conversations(cfg.limit or TINY_CHAT_ROWS, seed=seed)
        return None, (Record(f"{src} row {i + 1}", r) for i, r in enumerate(rows))
    if src == INSTRUCTIONS:
        from dspark_kit.data.instructions import instruction_conversations

        rows = instruction_conversations(cfg.limit or TINY_CHAT_ROWS, seed=seed)
        return None, (Record(f"{src} row {i + 1}", {"messages": m}) for i, m in enumerate(rows))
    if src == CODE:
        from dspark_kit.data.code_prompts import code_conversations

        rows = code_conversations(cfg.limit or TINY_CHAT_ROWS, seed=seed)
        return None, (Record(f"{src} row {i + 1}", {"messages": m}) for i, m in enumerate(rows))
    if src.startswith("builtin:"):
        raise SourceError(f"data.source {src!r}: unknown builtin (only {TINY_CHAT}, {TINY_TOOLS}, {INSTRUCTIONS} "
                          f"and {CODE})")
    path = Path(src).expanduser()
    if not path.exists() and (hub := hub_source(src, cfg)):  # a file of that name wins
        preset, name, config, split = hub
        return preset, read_hub(name, config, split, src)
    if not path.exists() and ":" in src and not Path(src).suffix:
        raise SourceError(f"data.source {src}: no such file, and not a preset ({', '.join(PRESETS)}); a hub "
                          f"dataset is {HUB_PREFIX}NAME[:CONFIG]:SPLIT, e.g. {HUB_PREFIX}{src}")
    return None, read_file(path, cfg.invalid_utf8, cfg.split)


def source_size(cfg: DataCfg) -> int | None:
    """How many rows iter_source reads at most, when that is cheap to know (the builtin corpus,
    a jsonl file's lines), for a progress bar; None otherwise."""
    src, n = cfg.source, None
    if src in (TINY_CHAT, TINY_TOOLS, INSTRUCTIONS, CODE):
        n = cfg.limit or TINY_CHAT_ROWS
    elif not src.startswith("builtin:"):
        path = Path(src).expanduser()
        if path.suffix.lower() in (".jsonl", ".ndjson") and path.is_file():
            with path.open("rb") as f:
                n = sum(1 for line in f if line.strip())
    return min(n, cfg.limit) if n is not None and cfg.limit else n


def iter_records(cfg: DataCfg, limit: int | None = None, seed: int = 0) -> Iterator[tuple[int, Record]]:
    """(idx, record) for each row read, at most `limit` (or data.limit); a preset's row mapped onto a
    readable schema, a row that does not map a BadLine with the reason."""
    limit = limit or cfg.limit
    preset, records = _records(cfg, seed)
    for idx, rec in enumerate(records):
        if limit is not None and idx >= limit:
            return
        if preset and not isinstance(rec.row, BadLine):
            try:
                rec = Record(rec.where, preset_row(preset, rec.row), rec.changes, rec.line)
            except ConversationError as e:
                rec = Record(rec.where, BadLine("", str(e), line=rec.line, where=rec.where), rec.changes, rec.line)
        yield idx, rec


def iter_rows(
    cfg: DataCfg,
    skipped: Counter | None = None,
    limit: int | None = None,
    seed: int = 0,
    changed: Counter | None = None,
    on_drop: Callable[[int, str, str], None] | None = None,
) -> Iterator[tuple[int, Any]]:
    """(idx, row) for each row read, at most `limit` (or data.limit); rows the file reader could not
    parse (or a preset row that does not map) are counted in `skipped` (and `on_drop(idx, where,
    reason)` told), what reading changed in `changed` (reason -> rows)."""
    skipped = skipped if skipped is not None else Counter()
    for idx, rec in iter_records(cfg, limit, seed):
        if isinstance(rec.row, BadLine):
            skipped[rec.row.reason] += 1
            if on_drop:
                on_drop(idx, rec.where, rec.row.reason)
            continue
        if changed is not None:
            changed.update(rec.changes)
        yield idx, (rec.row, rec.where) if on_drop else rec.row


def iter_chats(
    cfg: DataCfg,
    skipped: Counter | None = None,
    limit: int | None = None,
    seed: int = 0,
    formats: Counter | None = None,
    changed: Counter | None = None,
    on_drop: Callable[[int, str, str], None] | None = None,
    drop_repeated_prompts: bool = False,
) -> Iterator[tuple[int, list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """(idx, messages, tools or None) for each usable row, at most `limit` (or data.limit) rows read;
    `on_drop(idx, where, reason)` hears of each row dropped (where: file:line). drop_repeated_prompts
    (regen.repeated_prompts: drop): a row whose prompt repeats an earlier row's is dropped too; the
    others keep their index, so a resumed regen pairs every row with its own reply either way."""
    skipped = skipped if skipped is not None else Counter()
    tell = on_drop or (lambda *_: None)
    prompts: set[bytes] = set()  # digests: a 200k-row source's prompts are not held
    for idx, (row, where) in iter_rows(cfg, skipped, limit, seed, changed, tell):
        if formats is not None:
            formats[row_format(row) or "unknown"] += 1
        try:
            messages, tools = normalize(row), row_tools(row)
        except ConversationError as e:
            skipped[str(e)] += 1
            tell(idx, where, str(e))
            continue
        if drop_repeated_prompts:
            if (key := prompt_of(messages, tools)) in prompts:
                skipped[REPEATED_PROMPT] += 1
                tell(idx, where, REPEATED_PROMPT)
                continue
            prompts.add(key)
        yield idx, messages, tools


REPEATED_PROMPT = "repeats an earlier row's prompt (regen.repeated_prompts: drop)"


def prompt_of(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bytes:
    """A digest of what regen sends of a row: every turn but the assistant's replies (regen writes
    those), and the tools; two rows with the same prompt get the same greedy replies."""
    asked = [m for m in messages if m.get("role") != "assistant"]
    text = json.dumps([asked, tools], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def iter_source(
    cfg: DataCfg,
    skipped: Counter | None = None,
    limit: int | None = None,
    seed: int = 0,
    formats: Counter | None = None,
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(idx, messages) for each usable row (iter_chats without the tool schemas)."""
    return ((idx, msgs) for idx, msgs, _ in iter_chats(cfg, skipped, limit, seed, formats))
