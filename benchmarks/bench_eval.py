"""Acceptance on the CPU rehearsal: trained vs untrained draft, eval vs bench, and the draft window.

    .venv/bin/python benchmarks/bench_eval.py [--workdir TRAINED_RUN] [--json out.json]

All acceptance figures come from greedy decoding, so they are deterministic: machine
load changes none of them. Prompts: `tiny_corpus.write_eval_prompts` (held-out
single-turn chats, seed 9173, not the corpus the verifier or the draft trained on).

- trained vs untrained: `evaluate.evaluate_checkpoint` (the reference lossless decoder) on the same
  prompts at K = block size. The untrained draft is the trained checkpoint with its
  trained tensors re-drawn as at initialisation (matrices normal(0, 0.02), norm weights
  1, biases 0); embeddings and lm_head come from the verifier in both.
- bench vs eval: the local spec engine (`serve --role spec`) under `bench.bench_endpoint`
  with the same prompts, K, max tokens and window (off); its AL (from the /metrics
  deltas) should equal eval's.
- window: `evaluate.tune_window` (what `dspark-kit window tune` runs) at 2x, 4x and 8x
  the draft's training length, at the same K; the recommended window's AL over no window
  per length.

Without --workdir it trains the tiny recipe first (`dspark-kit run --stages
prepare,hidden-states,train`, which trains on the corpus replies instead of regen's).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from common import REPO, Row, cli, emit, this_command, trained_demo_run

RECIPE = REPO / "recipes" / "tiny-cpu.yaml"


def untrained_copy(checkpoint: Path, dest: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, dest, ignore=shutil.ignore_patterns("*.pt"))
    weights = dest / "model.safetensors"
    gen = torch.Generator().manual_seed(0)
    fresh = {}
    for name, t in load_file(str(weights)).items():
        if not t.is_floating_point():  # a reduced vocabulary's d2t/t2d maps: counted from the data, not trained
            fresh[name] = t
        elif name.endswith("bias"):
            fresh[name] = torch.zeros_like(t)
        elif "norm" in name:
            fresh[name] = torch.ones_like(t)
        else:
            fresh[name] = (torch.randn(t.shape, generator=gen) * 0.02).to(t.dtype)
    save_file(fresh, str(weights), metadata={"format": "pt"})
    return dest


def bench_al(recipe, wd: Path, prompts: Path, n: int, max_tokens: int, out: Path) -> float | None:
    """AL of the local spec engine serving recipe.serve.checkpoint, from bench's /metrics deltas."""
    from dspark_kit.engines.ports import free_port
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.server_plan import running_server
    from dspark_kit.stages.serving.bench import bench_endpoint

    resolved = Resolved(recipe, wd, window="off")  # as the eval it is compared with (a tuned window would differ)
    with running_server(resolved, "spec", port=free_port()) as url:
        res = bench_endpoint(resolved, url, label="bench-eval", out_dir=out, num_prompts=n, concurrency=1,
                        max_tokens=max_tokens, dataset=str(prompts))
    return res["spec_decode"]["acceptance_length"]


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, help="a trained tiny run (checkpoints/checkpoint_best)")
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the block size)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--multiples", default="2,4,8", help="long contexts, as multiples of the training length")
    ap.add_argument("--windows", default=None, help="window candidates for the sweep (default: window tune's)")
    ap.add_argument("--tune-prompts", type=int, default=4)
    ap.add_argument("--tune-new-tokens", type=int, default=32)
    ap.add_argument("--no-bench", action="store_true", help="skip the served (bench) measurement")
    args = ap.parse_args()
    import torch

    from dspark_kit.data.tiny_corpus import write_eval_prompts
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.specdec.checkpoints import resolve_checkpoint
    from dspark_kit.stages.evaluation.evaluate import evaluate_checkpoint, tune_window

    torch.set_num_threads(1)  # tiny matmuls: one thread is faster than two on a shared box
    base = load_recipe(RECIPE, ["train.device=cpu"])
    k = args.k or base.draft.block_size
    sets = ["train.device=cpu", f"serve.num_speculative_tokens={k}"]
    recipe = load_recipe(RECIPE, sets)
    tmp = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    n, m = args.num_prompts, args.max_new_tokens
    try:
        wd = trained_demo_run(args.workdir, tmp)
        best = resolve_checkpoint(wd / "checkpoints")
        prompts = write_eval_prompts(tmp / "eval_prompts.jsonl", 32)
        kw = {"prompts_file": prompts, "context_lengths": [], "num_prompts": n, "max_new_tokens": m}
        trained = evaluate_checkpoint(Resolved(recipe, wd, checkpoint=best, window="off"), out_dir=tmp / "eval-t", **kw)
        untrained = evaluate_checkpoint(Resolved(recipe, wd, checkpoint=untrained_copy(best, tmp / "untrained"), window="off"),
                             out_dir=tmp / "eval-u", **kw)
        # bench shuffles a jsonl and takes the first n: give it exactly eval's n prompts
        bench_prompts = write_eval_prompts(tmp / "bench_prompts.jsonl", n)
        served = None if args.no_bench else bench_al(load_recipe(RECIPE, [*sets, f"serve.checkpoint={best}"]), wd,
                                                     bench_prompts, n, m, tmp / "bench")
        tw = recipe.training_window
        ctx = [int(x) * tw for x in args.multiples.split(",") if x]
        cands = [int(x) for x in args.windows.split(",")] if args.windows else None
        tune = tune_window(Resolved(recipe, wd, checkpoint=best), candidates=cands, context_lengths=ctx, ks=[k],
                           num_prompts=args.tune_prompts,
                           max_new_tokens=args.tune_new_tokens, prompts_file=prompts, allow_below=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    t_al, u_al = trained["acceptance_length"], untrained["acceptance_length"]
    rows = [
        Row("acceptance", "untrained draft AL (held-out prompts)", u_al, notes=f"K={k}; random init; {n} prompts x {m} tokens"),
        Row("acceptance", "trained draft AL (held-out prompts)", t_al, goal=">= 3.0", met=bool(t_al and t_al >= 3.0),
            notes=f"K={k} = block size; demo recipe"),
        Row("acceptance", "trained / untrained AL", t_al / u_al if t_al and u_al else None, "x",
            ">= 2.5x", bool(t_al and u_al and t_al / u_al >= 2.5), notes="same prompts, same K"),
    ]
    if served is not None:
        rows.append(Row("acceptance", "bench AL (local spec engine) - eval AL", served - t_al, "",
                        "within 0.05", abs(served - t_al) <= 0.05,
                        notes=f"bench {served:.3f} vs eval {t_al:.3f}; same prompts, K, max tokens"))
    meas = tune["measurements"]

    def al(w, c):
        return next((x["acceptance_length"] for x in meas
                     if x["k"] == k and x["window"] == w and x["context_length"] == c), None)

    rec = tune["recommended_window"]
    sweep = "; ".join(f"{c}: " + ", ".join(f"{w or 'off'} {al(w, c)}" for w in [None, *tune["candidates"]])
                      for c in ctx)
    rows.append(Row("acceptance", "window tune: recommended window", rec if rec is not None else "none",
                    goal="a window", met=rec is not None,
                    notes=f"training length {tw}; AL per context, window: {sweep}"))
    for mult, c in zip(args.multiples.split(","), ctx, strict=True):
        off, on = al(None, c), al(rec, c) if rec is not None else None
        goal = ">= 1.3x" if mult == "4" else ""
        ratio = on / off if on and off else None
        rows.append(Row("acceptance", f"AL at {mult}x training length ({c}): window {rec} / no window",
                        ratio, "x", goal, (ratio is not None and ratio >= 1.3) if goal else None,
                        notes=f"{on} / {off}; {args.tune_prompts} prompts x {args.tune_new_tokens} tokens"))
    emit(rows, args.json, this_command("bench_eval.py", "--workdir WORKDIR" if args.workdir else ""))


if __name__ == "__main__":
    main()
