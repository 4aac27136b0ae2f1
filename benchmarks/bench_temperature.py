"""Acceptance at the temperature people serve: drafts trained on greedy vs sampled regen (issue 39).

    .venv/bin/python benchmarks/bench_temperature.py [--rows 256] [--epochs 8] [--prompts 16]
                                                     [--temperatures 0,0.6,1.0] [--only greedy]
                                                     [--workdir DIR] [--json out.json]

Two drafts train on the same `--rows` conversations of the tiny corpus for the same epochs through
`dspark-kit run --stages regen,prepare,hidden-states,train` on recipes/tiny-cpu.yaml: one on regen at
temperature 0 (the recipe as shipped: with the defaults it is the demo's draft) and one on a 50/50
temperature mixture (`regen.temperature={0.0: 0.5, 0.7: 0.5}`: each row's temperature drawn from its
index). Eval then measures each draft's acceptance length at each `--temperatures` (eval.temperature:
greedy at 0, lossless speculative sampling above) on the tiny corpus's held-out prompts, each request
seeded by its index, so a rerun gives the same figures; machine load changes the time only.
Question (issue 39): does sampled training data help acceptance when serving is sampled? No goal is
set: the rows report what the drafts do.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, cli, emit, this_command, train_through_cli

RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
DRAFTS = {"greedy": ("regen at temperature 0", None), "mixture": ("regen at {0: 0.5, 0.7: 0.5}", "{0.0: 0.5, 0.7: 0.5}")}


train = train_through_cli  # the two runs compared train alike (benchmarks/common.py)


def acceptance(wd: Path, sets: list[str], temperature: float, prompts: int) -> dict:
    """eval's acceptance length of the run's draft at `temperature`."""
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.evaluation.evaluate import evaluate_checkpoint

    recipe = load_recipe(RECIPE, [*sets, f"eval.temperature={temperature}", "eval.categories=[]"])
    s = evaluate_checkpoint(Resolved(recipe, wd), num_prompts=prompts, out_dir=wd / f"eval-t{temperature:g}")
    return {"al": s["acceptance_length"], "per_position": s["per_position_acceptance"], "ids": s["prompts"]["ids"],
            "temperature": s["temperature"]}


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, help="source conversations each draft trains on (default: data.limit)")
    ap.add_argument("--epochs", type=int, help="train.epochs, the same for both drafts (default: the recipe's)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out eval prompts per temperature")
    ap.add_argument("--temperatures", default="0,0.6,1.0", help="eval temperatures, comma-separated")
    ap.add_argument("--only", choices=sorted(DRAFTS), help="measure one draft only")
    ap.add_argument("--workdir", type=Path, help="keep the runs here (a rerun resumes them); default: a temp dir")
    args = ap.parse_args()
    temps = [float(t) for t in args.temperatures.split(",")]
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-temperature-"))
    common = [*([f"data.limit={args.rows}"] if args.rows else []), *([f"train.epochs={args.epochs}"] if args.epochs else [])]
    t0 = time.time()
    results: dict[str, dict] = {}
    try:
        for key, (name, mix) in DRAFTS.items():
            if args.only and key != args.only:
                continue
            wd = root / key
            sets = [*common, *([f"regen.temperature={mix}"] if mix else [])]
            t = time.time()
            summary = train(wd, sets)
            print(f"{name}: trained in {time.time() - t:.0f}s ({summary['conversations_used']} conversations)",
                  file=sys.stderr, flush=True)
            results[key] = {"summary": summary}
            for temp in temps:
                t = time.time()
                results[key][temp] = acceptance(wd, sets, temp, args.prompts)
                print(f"{name}: eval at {temp:g}: AL {results[key][temp]['al']:.3f} ({time.time() - t:.0f}s)",
                      file=sys.stderr, flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.rows or 'data.limit'} source rows per draft, {args.epochs or 'train.epochs'} epochs, "
          f"{args.prompts} held-out prompts per temperature, {time.time() - t0:.0f}s in all\n")
    print("| draft trained on | " + " | ".join(f"AL at T={t:g}" for t in temps) + " |\n|---|" + "---|" * len(temps))
    for key, r in results.items():
        print(f"| {DRAFTS[key][0]} | " + " | ".join(f"{r[t]['al']:.3f}" for t in temps) + " |")
    same = all(len({tuple(r[t]["ids"]) for r in results.values()}) == 1 for t in temps)
    print(f"\nall drafts measured on the same prompts: {'yes' if same else 'NO'}\n")
    rows = [Row("temperature", f"{DRAFTS[key][0]}: acceptance length at T={t:g}", r[t]["al"], "",
                "", None, f"per-position {r[t]['per_position']}")
            for key, r in results.items() for t in temps]
    extra = " ".join([*([f"--rows {args.rows}"] if args.rows else []), *([f"--epochs {args.epochs}"] if args.epochs else []),
                      f"--prompts {args.prompts}", f"--temperatures {args.temperatures}"])
    emit(rows, args.json, this_command("bench_temperature.py", extra))


if __name__ == "__main__":
    main()
