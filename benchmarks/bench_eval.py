"""Acceptance: trained vs untrained draft, and AL vs context length with and without a draft window.

    .venv/bin/python benchmarks/bench_eval.py [--workdir TRAINED_RUN] [--json out.json]

Uses dspark_kit.stages.evaluate.run_eval (the reference lossless greedy decoder). The
untrained draft is the trained checkpoint with its trained tensors re-drawn as at
initialisation (matrices normal(0, 0.02), norm weights 1, biases 0); embeddings and
lm_head come from the verifier in both. Without --workdir it trains the tiny recipe
first (`dspark-kit run --stages prepare,hidden-states,train`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, Row, cli, emit, this_command

RECIPE = REPO / "recipes" / "tiny-cpu.yaml"


def untrained_copy(checkpoint: Path, dest: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, dest, ignore=shutil.ignore_patterns("*.pt"))
    weights = dest / "model.safetensors"
    gen = torch.Generator().manual_seed(0)
    fresh = {}
    for name, t in load_file(str(weights)).items():
        if name.endswith("bias"):
            fresh[name] = torch.zeros_like(t)
        elif "norm" in name:
            fresh[name] = torch.ones_like(t)
        else:
            fresh[name] = (torch.randn(t.shape, generator=gen) * 0.02).to(t.dtype)
    save_file(fresh, str(weights), metadata={"format": "pt"})
    return dest


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, help="a trained tiny run (checkpoints/checkpoint_best)")
    ap.add_argument("--contexts", default="512,1024,2048", help="long-context prompt lengths, tokens")
    args = ap.parse_args()
    from dspark_kit.recipe import load_recipe
    from dspark_kit.spec.checkpoints import resolve_checkpoint
    from dspark_kit.stages.evaluate import run_eval

    recipe = load_recipe(RECIPE, ["train.device=cpu"])
    tmp = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    try:
        wd = args.workdir
        if not wd or not (wd / "checkpoints").is_dir():
            wd = tmp / "run"
            subprocess.run([sys.executable, "-m", "dspark_kit", "run", str(RECIPE), "--stages",
                            "prepare,hidden-states,train", "--workdir", str(wd), "--json"],
                           check=True, stdout=subprocess.DEVNULL)
        wd = Path(wd)
        best = resolve_checkpoint(wd / "checkpoints")
        window = recipe.training_window
        ctx = [int(x) for x in args.contexts.split(",") if x]
        trained = run_eval(recipe, wd, best, context_lengths=ctx, draft_window_size=window, out_dir=tmp / "eval-t",
                           num_prompts=4, max_new_tokens=32)
        untrained = run_eval(recipe, wd, untrained_copy(best, tmp / "untrained"), context_lengths=[],
                             draft_window_size="off", out_dir=tmp / "eval-u", num_prompts=4, max_new_tokens=32)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def al(context: int, w) -> float | None:
        return next((r["acceptance_length"] for r in trained["runs"]
                     if r["context_length"] == context and r["window"] == w), None)

    k = trained["num_speculative_tokens"]
    t_short, u_short = al(0, None), untrained["acceptance_length"]
    rows = [
        Row("acceptance", "untrained draft AL (short prompts)", u_short, notes=f"K={k}; random init"),
        Row("acceptance", "trained draft AL (short prompts)", t_short, notes="tiny recipe, 2 epochs"),
        Row("acceptance", "trained / untrained AL", t_short / u_short if t_short and u_short else None, "x",
            "> 1x", bool(t_short and u_short and t_short > u_short)),
    ]
    for c in ctx:
        off, on = al(c, None), al(c, window)
        rows.append(Row("acceptance", f"AL at context {c}: no window / window {window}", f"{off} / {on}",
                        goal=">= no window", met=None if off is None or on is None else on >= off,
                        notes=f"training window {window} (data.seq_length)"))
    long = 8 * window  # the goal: the window restores >= 1.3x AL at 8x the training length
    if long in ctx:
        off, on = al(long, None), al(long, window)
        rows.append(Row("acceptance", f"AL with / without window at 8x training length ({long})",
                        on / off if on and off else None, "x", ">= 1.3x", bool(on and off and on / off >= 1.3),
                        notes="4 prompts x 32 new tokens"))
    emit(rows, args.json, this_command("bench_eval.py", "--workdir WORKDIR" if args.workdir else ""))


if __name__ == "__main__":
    main()
