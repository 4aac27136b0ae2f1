"""`dspark-kit train`'s launch path vs plain `speculators train`, same flags, tiny recipe.

    .venv/bin/python benchmarks/bench_train.py [--repeats 3] [--json out.json]

Ours: the train stage's plan (dspark_kit.stages.steps) + dspark_kit.stages.training.train.run_training, i.e.
`python -m dspark_kit.compat.train_entry --dspark-device cpu FLAGS` with patch probes and
the log tee. Baseline: benchmarks/plain_speculators_train.py FLAGS -- speculators'
own train main with only the CPU device patches applied (plain speculators cannot
train on a CPU otherwise). One untimed warm-up, then --repeats interleaved pairs; the
median per-pair wall-time ratio (and its range) is reported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, cli, emit, paired_ratios, this_command

GOAL = 1.02


def val_accept_len(checkpoints: Path) -> float | None:
    from dspark_kit.stages.training.train import read_val_metrics

    m = read_val_metrics(checkpoints) or {}
    return m.get("accept_len_epoch") or next((v for k, v in m.items() if "accept" in k), None)


def launch_overhead_s() -> float:
    """Seconds train_entry spends before speculators' main that plain speculators does not:
    device detection, patch probes and the patches (speculators itself is imported by both)."""
    import speculators.train.cli  # noqa: F401 - imported by both sides, not counted

    from dspark_kit.compat.patches import apply_for_training
    from dspark_kit.devices import detect_device

    t0 = time.perf_counter()
    apply_for_training(detect_device("cpu"))
    return time.perf_counter() - t0


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, help="reuse a work dir with prepared/ and hidden states")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="recipe override, e.g. train.epochs=1 (both sides train the same)")
    args = ap.parse_args()
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.steps import REGISTRY, run_stage
    from dspark_kit.stages.training.train import run_training

    # regen off: the launch path is what is measured, on the data source as is
    recipe = load_recipe(REPO / "recipes" / "tiny-cpu.yaml", ["train.device=cpu", "regen.enabled=false", *args.sets])
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        wd = tmp / "run"
        wd.mkdir()
        res = Resolved(recipe, wd)
        if args.workdir and (args.workdir / "prepared" / "hidden_states").is_dir():
            shutil.copytree(args.workdir / "prepared", wd / "prepared")
        else:
            run_stage("prepare", res)
            run_stage("hidden-states", res)
        plan = REGISTRY["train"].plan(res).process("trainer").launch
        flags = plan.argv[plan.argv.index("--dspark-device") + 2 :]
        env = {**os.environ, **plan.env, "PYTHONUNBUFFERED": "1"}

        def fresh() -> None:
            shutil.rmtree(wd / "checkpoints", ignore_errors=True)
            shutil.rmtree(wd / "logs", ignore_errors=True)
            (wd / "logs").mkdir()

        def ours() -> float:
            fresh()
            t0 = time.perf_counter()
            real_stderr, sys.stderr = sys.stderr, open(os.devnull, "w")  # noqa: SIM115 - the tee still runs, unseen
            try:
                code, gone = run_training(plan, wd / "logs" / "train.log")  # no watch: `gone` stays None
            finally:
                sys.stderr.close()
                sys.stderr = real_stderr
            assert code == 0 and gone is None, (wd / "logs" / "train.log").read_text()[-2000:]
            return time.perf_counter() - t0

        def plain() -> float:
            fresh()
            argv = [sys.executable, str(REPO / "benchmarks" / "plain_speculators_train.py"), *flags]
            t0 = time.perf_counter()
            with (wd / "logs" / "plain.log").open("w") as log:
                code = subprocess.run(argv, check=False, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            assert code == 0, (wd / "logs" / "plain.log").read_text()[-2000:]
            return time.perf_counter() - t0

        plain()  # warm-up: first-run import/compile caches would otherwise land on one side
        al: dict[str, object] = {}

        def plain_al() -> float:
            t = plain()
            al["plain"] = val_accept_len(wd / "checkpoints")
            return t

        def ours_al() -> float:
            t = ours()
            al["ours"] = val_accept_len(wd / "checkpoints")
            return t

        pr = paired_ratios(plain_al, ours_al, args.repeats)  # ratio = plain / ours time
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    o, p = pr["subject_s"], pr["baseline_s"]
    rel = 1 / pr["ratio"]  # ours / plain wall time: the median of per-pair ratios
    probes = launch_overhead_s()
    same = al["ours"] == al["plain"]
    emit([
        Row("train", "plain speculators train (+CPU device patches)", p, "s", notes="median wall"),
        Row("train", "dspark-kit train launch path", o, "s", notes="median wall"),
        Row("train", "dspark-kit / plain wall time", rel, "x", f"<= {GOAL}x", rel <= GOAL,
            notes=f"median of {pr['pairs']} interleaved pairs, range {1 / pr['hi']:.3f}-{1 / pr['lo']:.3f}; same val accept_len: {'yes' if same else 'no'} ({al['ours']} vs {al['plain']}); baseline applies the same CPU patches in a wrapper"),
        Row("train", "what the launch path adds: probes + patches / plain wall", probes / p, "x", "<= 0.02x", probes / p <= 0.02,
            notes=f"{probes:.2f}s measured alone (run-to-run wall noise is larger than this)"),
    ], args.json, this_command("bench_train.py", " ".join([f"--repeats {args.repeats}", *(f"--set {x}" for x in args.sets)])))


if __name__ == "__main__":
    main()
