"""Local copies of every built-in benchmark in its hub set's own schema (columns and turn
structure), so the suite loader runs offline through `datasets` as it would on the hub's files."""

from __future__ import annotations

import json
from pathlib import Path

from dspark_kit.data.benchmarks import BENCHMARKS, SPEED_CATEGORIES

QUESTIONS = ["What is 12 times 7?", "Name three primary colours.", "Write a haiku about rain.",
             "Explain recursion in one sentence.", "How many days are in a leap year?",
             "Reverse the string 'abc' in Python.", "What is the capital of Italy?", "List two prime numbers.",
             "Sum the numbers 1 to 10.", "Translate 'hello' to French.", "Define an even number.",
             "Sort [3, 1, 2] ascending."]


def row(name: str, i: int) -> dict:
    q = QUESTIONS[i % len(QUESTIONS)]
    b = BENCHMARKS[name]
    if name == "mt-bench":
        return {"prompt": [q, "Now say it in fewer words."], "prompt_id": 80 + i, "category": "writing"}
    if name == "arena-hard":
        return {"question_id": f"q{i}", "category": "arena-hard-v0.1", "cluster": "c", "turns": [{"content": q}]}
    if name == "alpaca":
        return {"instruction": q, "input": "" if i % 2 else "Be brief.", "output": "..."}
    if name == "humaneval":
        return {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"{q}\"\"\"\n", "entry_point": f"f{i}"}
    if name.startswith("speed-"):
        return {"question_id": f"s{i}", "category": SPEED_CATEGORIES[i % len(SPEED_CATEGORIES)], "turns": [q]}
    out = {b.fields[0]: q}
    if b.id_field:
        out[b.id_field] = f"{name}-{i}"
    return out


def write_copies(folder: Path, names: list[str], rows: int = 12) -> dict[str, Path]:
    """One jsonl per benchmark (SPEED-Bench's categories share one file, as the hub's split does)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        n = rows * len(SPEED_CATEGORIES) if name.startswith("speed-") else rows
        file = folder / f"{name}.jsonl"
        file.write_text("".join(json.dumps(row(name, i)) + "\n" for i in range(n)), encoding="utf-8")
        out[name] = file
    return out
