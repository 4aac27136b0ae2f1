"""Every tiny verifier family through the whole pipeline, and its builder's quality on this machine.

    .venv/bin/python benchmarks/bench_families.py [--families qwen3,llama3] [--rebuild] [--json out.json]

Per family (data/families.py), each in a fresh run folder and a fresh kit cache (a cold start: the
shipped verifier unpacked, the speculators fix probes run):

- `dspark-kit run recipes/tiny-<family>-cpu.yaml --json` (the demo: regen through the local engine,
  prepare, hidden states, train, eval, serve, bench, report), its wall time;
- rows written by regen and trained on (prepare's rows);
- held-out acceptance length of the trained draft (eval's figure, in-process), and of the same
  checkpoint with its trained tensors re-drawn as at initialisation (bench_eval.untrained_copy), on
  the same prompts: the trained/untrained ratio, goal >= 2x;
- the served acceptance length (bench's, from the engine's /metrics) over the in-process one.

With --rebuild it also rebuilds each family's verifier from its recipe in the builder (~5-15 min
each on one core) and compares the held-out loss with the shipped build's: "as good as" means at most
15 % above it (tests/test_tiny_verifier_shipped.py checks the Qwen3 build in `make test`).

Acceptance figures are greedy and deterministic; wall times are this machine's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_eval import untrained_copy
from common import REPO, Row, cli, emit, this_command

MARGIN = 2.0
HELDOUT_BAND = 0.15


def recipe_of(family: str) -> Path:
    return REPO / "recipes" / ("tiny-cpu.yaml" if family == "qwen3" else f"tiny-{family}-cpu.yaml")


def pipeline_rows(family: str, tmp: Path) -> list[Row]:
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.specdec.checkpoints import resolve_checkpoint
    from dspark_kit.stages.evaluation.evaluate import evaluate_checkpoint

    wd, cache = tmp / f"{family}-run", tmp / f"{family}-cache"
    env = {**os.environ, "DSPARK_KIT_CACHE": str(cache)}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "dspark_kit", "run", str(recipe_of(family)), "-w", str(wd), "--json"],
                          capture_output=True, text=True, env=env, cwd=REPO, check=False)
    wall = time.time() - t0
    name = f"family {family}"
    if proc.returncode != 0:
        return [Row(name, "demo", "failed", notes=proc.stderr.strip().splitlines()[-1][:200])]
    stages = {s["stage"]: s for s in json.loads(proc.stdout)["stages"]}
    regen = sum(1 for _ in (wd / "regen.jsonl").open())
    prepared = json.loads((wd / "prepared" / "prepare_meta.json").read_text())["summary"]
    evaluated = json.loads((wd / "eval" / "eval.json").read_text())
    os.environ["DSPARK_KIT_CACHE"] = str(cache)  # this process's eval reads the same verifier
    recipe = load_recipe(recipe_of(family))
    best = resolve_checkpoint(wd / "checkpoints")
    prompts = evaluated.get("prompts") or {}
    untrained = evaluate_checkpoint(Resolved(recipe, wd, checkpoint=untrained_copy(best, tmp / f"{family}-untrained")),
                                    out_dir=tmp / f"{family}-eval-untrained", categories=[])
    t_al, u_al = evaluated["acceptance_length"], untrained["acceptance_length"]
    served = stages.get("bench", {}).get("figure")
    rows = [
        Row(name, "demo wall time (cold cache)", round(wall, 1), "s"),
        Row(name, "rows written by regen / training rows", f"{regen} / {prepared.get('rows_out')}"),
        Row(name, "held-out AL trained / untrained", f"{t_al:.3f} / {u_al:.3f}",
            notes=f"K = {evaluated.get('num_speculative_tokens')}; {prompts.get('count')} prompts of "
                  f"{prompts.get('source')} (held out: {prompts.get('held_out')})"),
        Row(name, "trained / untrained AL", round(t_al / u_al, 2), "x", f">= {MARGIN}x", t_al >= MARGIN * u_al),
    ]
    if isinstance(served, (int, float)):
        rows.append(Row(name, "served / in-process AL", round(served / t_al, 3), "x",
                        notes=f"served {served:.3f} (bench, the local engine's /metrics)"))
    return rows


def rebuild_rows(family: str, tmp: Path) -> list[Row]:
    from dspark_kit.data import tiny_verifier as tiny
    from dspark_kit.data.families import FAMILIES

    fam = FAMILIES[family]
    shipped = tiny.shipped_manifest(tiny.shipped_dir(fam))
    t0 = time.time()
    out = tiny.ensure_tiny_verifier(root=tmp / f"{family}-rebuild", build=True, family=fam, log=lambda _m: None)
    built = json.loads((out / "build.json").read_text())
    limit = (1 + HELDOUT_BAND) * shipped["heldout_loss"]
    return [Row(f"family {family}", "rebuilt held-out loss / shipped", round(built["heldout_loss"] / shipped["heldout_loss"], 3),
                "x", f"<= {1 + HELDOUT_BAND:.2f}x", built["heldout_loss"] <= limit,
                notes=f"rebuilt {built['heldout_loss']} ({built['cpu_capability']}, {time.time() - t0:.0f} s), "
                      f"shipped {shipped['heldout_loss']} ({shipped['cpu_capability']})")]


def main() -> None:
    from dspark_kit.data.families import FAMILIES

    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma list (default: all of {', '.join(FAMILIES)})")
    ap.add_argument("--rebuild", action="store_true", help="also rebuild each verifier and compare its held-out loss")
    ap.add_argument("--no-pipeline", action="store_true", help="only the rebuilds")
    args = ap.parse_args()
    chosen = [f for f in args.families.split(",") if f]
    unknown = sorted(set(chosen) - set(FAMILIES))
    if unknown:
        ap.error(f"--families: unknown {unknown}; choose from {', '.join(FAMILIES)}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-families-"))
    rows: list[Row] = []
    try:
        for family in chosen:
            if not args.no_pipeline:
                rows += pipeline_rows(family, tmp)
            if args.rebuild:
                rows += rebuild_rows(family, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    emit(rows, args.json, this_command("bench_families.py", " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
