#!/usr/bin/env bash
# GPU smoke test (not part of the test suite): on a CUDA machine, train the tiny recipe's
# draft with flex attention and fused losses (speculators' CUDA defaults), then measure
# acceptance with the reference decoder on the GPU, and print a summary.
#
#   scripts/gpu_smoke.sh [WORKDIR]        # default: a fresh temp dir
#
# Exits 3 with a one-line message when no CUDA GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_smoke: no CUDA GPU visible (torch.cuda.is_available() is False); run this on a CUDA machine" >&2
  exit 3
fi

WD=${1:-$(mktemp -d "${TMPDIR:-/tmp}/dspark-gpu-smoke.XXXXXX")}
SETS=(--set train.device=cuda --set draft.attn_impl=simple_flex_attention --set train.loss_implementation=fused)
echo "gpu_smoke: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)')"
echo "gpu_smoke: workdir $WD"

t0=$SECONDS
"$PY" -m dspark_kit run recipes/tiny-cpu.yaml --workdir "$WD" --stages prepare,hidden-states,train \
  "${SETS[@]}" --json > "$WD/smoke_run.json"
train_s=$((SECONDS - t0))

eval_s="-" eval_al="not run (no dspark-kit eval)"
if "$PY" -m dspark_kit eval --help > /dev/null 2>&1; then
  t1=$SECONDS
  eval_al=$("$PY" - "$WD" "${SETS[@]}" <<'PY'
import sys
from pathlib import Path
from dspark_kit.stages.evaluate import run_eval
from dspark_kit.recipe import load_recipe
wd, sets = Path(sys.argv[1]), [a for a in sys.argv[2:] if a != "--set"]
s = run_eval(load_recipe("recipes/tiny-cpu.yaml", sets), wd, device="cuda", out_dir=wd / "eval-gpu")
print(f"{s['acceptance_length']} (K={s['num_speculative_tokens']}, per position {s['per_position_acceptance']})")
PY
)
  eval_s=$((SECONDS - t1))
fi

"$PY" - "$WD" "$train_s" "$eval_s" "$eval_al" <<'PY'
import json, sys
from pathlib import Path
from dspark_kit.stages.train import read_val_metrics
wd, train_s, eval_s, eval_al = Path(sys.argv[1]), *sys.argv[2:]
argv = json.loads((wd / "manifest.json").read_text())["stages"]["train"]["argv"]
flag = lambda f: argv[argv.index(f) + 1] if f in argv else "(speculators default)"
val = read_val_metrics(wd / "checkpoints") or {}
print("gpu_smoke summary")
print(f"  train          {train_s}s  attn={flag('--draft-attn-impl')}  loss={flag('--loss-implementation')}")
print(f"  val accept_len {val.get('accept_len_epoch', val)}")
print(f"  eval (cuda)    {eval_s}s  acceptance length {eval_al}")
print(f"  outputs        {wd}")
PY
