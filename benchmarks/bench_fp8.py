"""fp8 hidden states vs bfloat16 on the tiny recipe: bytes on disk and the trained draft's acceptance.

    .venv/bin/python benchmarks/bench_fp8.py [--rows 64] [--seeds 42 1 2 3 4] [--json out.json]

One regen of `--rows` tiny conversations; prepare and the hidden-states stage (backend local) in
each dtype from the same regen rows, so both trainers see the same rows and the same verifier
states, bf16-rounded or fp8-quantized; then the train stage once per seed in each dtype
(`--set train.seed=S`, everything else the tiny recipe's). Figures: the files' bytes (fp8 / bf16)
and the val accept_len (teacher-forced, the train stage's own figure) per seed, the mean of the
per-seed differences and their range. Acceptance varies more between seeds than between the
dtypes, hence several seeds. Not part of run_all.py (about 5-10 minutes on 2 busy cores).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, Row, cli, emit, this_command

RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
DTYPES = ("bfloat16", "fp8")


def kit_run(wd: Path, stages: str, *sets: str) -> dict:
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(RECIPE), "-w", str(wd), "--stages", stages, "--json",
           *[a for s in sets for a in ("--set", s)]]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return {s["stage"]: s for s in json.loads(out.stdout)["stages"]}


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64, help="tiny conversations regenerated (data.limit)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2, 3, 4])
    args = ap.parse_args()
    limit = f"data.limit={args.rows}"
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "regen"
        kit_run(base, "regen", limit)
        size, al = {}, {d: [] for d in DTYPES}
        for dtype in DTYPES:
            wd = Path(tmp) / dtype
            wd.mkdir()
            shutil.copy(base / "regen.jsonl", wd / "regen.jsonl")
            kit_run(wd, "prepare,hidden-states", limit, f"hidden_states.dtype={dtype}")
            size[dtype] = sum(f.stat().st_size for f in (wd / "prepared" / "hidden_states").glob("hs_*.safetensors"))
            for seed in args.seeds:  # a fresh run folder per seed: train resumes from checkpoints it finds
                run = Path(tmp) / f"{dtype}-{seed}"
                run.mkdir()
                shutil.copytree(wd / "prepared", run / "prepared")
                stages = kit_run(run, "train", limit, f"hidden_states.dtype={dtype}", f"train.seed={seed}")
                al[dtype].append(stages["train"]["figure"])
                print(f"[fp8] {dtype} seed {seed}: val accept_len {al[dtype][-1]:.3f}", file=sys.stderr)
    diffs = [f - b for f, b in zip(al["fp8"], al["bfloat16"], strict=True)]
    per_seed = ", ".join(f"{s}: {b:.3f} / {f:.3f}" for s, b, f in zip(args.seeds, al["bfloat16"], al["fp8"], strict=True))
    mean_b, mean_f = statistics.mean(al["bfloat16"]), statistics.mean(al["fp8"])
    rows = [
        Row("fp8", "hidden-state files fp8 / bf16 bytes", size["fp8"] / size["bfloat16"], "x", "<= 0.52",
            size["fp8"] / size["bfloat16"] <= 0.52, f"{size['fp8']:,} / {size['bfloat16']:,} B"),
        Row("fp8", "val accept_len bf16 (mean over seeds)", mean_b, notes=per_seed + " (seed: bf16 / fp8)"),
        Row("fp8", "val accept_len fp8 (mean over seeds)", mean_f),
        Row("fp8", "fp8 - bf16 val accept_len (mean of per-seed differences)", statistics.mean(diffs), "",
            ">= -0.05", statistics.mean(diffs) >= -0.05,
            f"per seed {min(diffs):+.3f} .. {max(diffs):+.3f}; {len(diffs)} seeds, {args.rows} conversations"),
    ]
    emit(rows, args.json, this_command("bench_fp8.py", f"--rows {args.rows} --seeds {' '.join(map(str, args.seeds))}"))


if __name__ == "__main__":
    main()
