"""A 50/50 thinking mixture against single-mode drafts at equal rows, on the tiny recipe (issue 31).

    .venv/bin/python benchmarks/bench_thinking_mixture.py [--rows 128] [--epochs 4] [--prompts 32]
                                                          [--workdir DIR] [--json out.json]

Three drafts train on the same `--rows` conversations of the tiny corpus for the same epochs:
one regenerated in thinking mode, one without, and one as a 50/50 mixture
(`verifier.thinking={true: 0.5, false: 0.5}`: each row's mode drawn from its index, recorded by regen,
rendered in it by prepare). Each goes `dspark-kit run --stages regen,prepare,hidden-states,train` on
recipes/tiny-cpu.yaml (CPU, the tiny verifier through the local engine, greedy). Eval then measures
each draft's acceptance length in each mode (`eval.thinking=true|false`) on the tiny corpus's held-out
prompts. Goal (issue 31): in each mode, the mixture's acceptance >= 0.9x the draft trained on that
mode alone.

Why regen rather than the corpus rendered per mode (`regen.enabled=false`): the corpus's replies carry
no reasoning, so in thinking mode they would train on empty think blocks, while the verifier asked in
thinking mode writes a think block with reasoning, and eval measures what the verifier writes. Regen
trains every draft on the verifier's own output in each row's mode, as a user's run does.
Acceptance is deterministic (greedy): machine load changes the time, not the figures.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, cli, emit, this_command, train_through_cli

GOAL = 0.9
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
DRAFTS = {"thinking only": "true", "non-thinking only": "false", "50/50 mixture": "{true: 0.5, false: 0.5}"}
MODES = {"thinking": "true", "non-thinking": "false"}


train = train_through_cli  # the two runs compared train alike (benchmarks/common.py)


def acceptance(wd: Path, sets: list[str], mode: str, prompts: int) -> dict:
    """eval's acceptance length of the run's draft, prompts rendered (and the verifier generating) in `mode`."""
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.evaluation.evaluate import evaluate_checkpoint

    recipe = load_recipe(RECIPE, [*sets, f"eval.thinking={mode}", "eval.categories=[]"])
    s = evaluate_checkpoint(Resolved(recipe, wd), num_prompts=prompts, out_dir=wd / f"eval-thinking-{mode}")
    return {"al": s["acceptance_length"], "per_position": s["per_position_acceptance"], "ids": s["prompts"]["ids"]}


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128, help="source conversations each draft trains on (data.limit)")
    ap.add_argument("--epochs", type=int, default=4, help="train.epochs, the same for the three drafts")
    ap.add_argument("--prompts", type=int, default=32, help="held-out eval prompts per mode")
    ap.add_argument("--workdir", type=Path, help="keep the three runs here (a rerun resumes them); default: a temp dir")
    args = ap.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-mixture-"))
    common = [f"data.limit={args.rows}", f"train.epochs={args.epochs}", "train.device=cpu"]
    t0 = time.time()
    results: dict[str, dict] = {}
    try:
        for name, thinking in DRAFTS.items():
            wd = root / name.split()[0].replace("/", "-")
            sets = [*common, f"verifier.thinking={thinking}"]
            t = time.time()
            summary = train(wd, sets)
            print(f"{name}: trained in {time.time() - t:.0f}s ({summary['conversations_used']} conversations, "
                  f"modes {summary.get('thinking_rows')})", file=sys.stderr, flush=True)
            results[name] = {"summary": summary, **{m: acceptance(wd, sets, v, args.prompts) for m, v in MODES.items()}}
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.rows} source rows per draft, {args.epochs} epochs, {args.prompts} held-out prompts per mode, "
          f"{time.time() - t0:.0f}s in all\n")
    print("| draft trained on | conversations used (thinking / off) | trained tokens | AL, thinking mode "
          "| AL, non-thinking mode |\n|---|---|---|---|---|")
    for name, r in results.items():
        s, modes = r["summary"], r["summary"].get("thinking_rows", {})
        print(f"| {name} | {s['conversations_used']} ({modes.get('true', 0)} / {modes.get('false', 0)}) "
              f"| {s['trainable_tokens']:,} | {r['thinking']['al']:.3f} | {r['non-thinking']['al']:.3f} |")
    same = all(len({tuple(r[m]["ids"]) for r in results.values()}) == 1 for m in MODES)
    print(f"\nthe three drafts measured on the same prompts in each mode: {'yes' if same else 'NO'}\n")
    rows = []
    for mode, single in (("thinking", "thinking only"), ("non-thinking", "non-thinking only")):
        mix, alone = results["50/50 mixture"][mode]["al"], results[single][mode]["al"]
        ratio = mix / alone
        rows.append(Row("thinking mixture", f"{mode} mode: 50/50 mixture AL / {single} AL", round(ratio, 3), "x",
                        f">= {GOAL}x", ratio >= GOAL, f"AL {mix:.3f} vs {alone:.3f}; per-position "
                        f"{results['50/50 mixture'][mode]['per_position']} vs {results[single][mode]['per_position']}"))
    emit(rows, args.json, this_command("bench_thinking_mixture.py",
                                       f"--rows {args.rows} --epochs {args.epochs} --prompts {args.prompts}"))


if __name__ == "__main__":
    main()
