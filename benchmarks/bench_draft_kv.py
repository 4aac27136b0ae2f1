"""Speculative decoding speed against the verifier alone, with and without the draft's KV cache.

    .venv/bin/python benchmarks/bench_draft_kv.py [--workdir TRAINED_RUN] [--json out.json]

On the demo checkpoint (the tiny recipe's `dspark-kit run`), one torch thread, the
in-process decoder (`specdec.decoder`): for short prompts and for prompts of 2x, 4x
and 8x the draft's training length (history of earlier held-out chats prepended,
`evaluate.build_prompts`), the time to decode N held-out prompts x M tokens
(prefill included) with the verifier alone (`ReferenceDecoder`) over the time with
speculative decoding at K = block size, without a window and with the tuned window.
Greedy speculative decoding emits exactly the verifier's tokens, so the time ratio
is the tokens/s ratio. Times are the process's CPU seconds (one thread: the wall
time of a quiet machine, and stable on a busy one). Each ratio is the median of
interleaved pairs (`common.paired_ratios`): verifier alone, speculative, alone, ...

"before" recomputes the draft's context K/V every step (`draft_kv_cache=False`, the
reference path); "after" keeps them in the draft's KV cache (what serving runs).
The draft's own cost per drafted block is also measured at each length (no window):
recompute over cached, what the cache removes from every step.

Without --workdir it trains the tiny recipe first (`dspark-kit run --stages
prepare,hidden-states,train`).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, cli, emit, paired_ratios, spread, this_command, trained_demo_run

RECIPE = REPO / "recipes" / "tiny-cpu.yaml"


def timed(fn, prompts) -> float:
    """CPU seconds of this process (one torch thread): on a quiet machine the wall time, and
    unlike the wall time it does not grow when other processes share the cores."""
    t0 = time.process_time()
    for p in prompts:
        fn(p)
    return time.process_time() - t0


def tuned_window(wd: Path, default: int) -> tuple[int, str]:
    """The run's tuned window when a tune recommended one, else `default`."""
    from dspark_kit.resolved import Tune
    from dspark_kit.rundir import RunDir

    tune = Tune.read(RunDir.at(wd).tune_file)  # the file serving's `auto` reads, read the same way
    if tune is not None and tune.window:
        return tune.window, f"tuned ({tune.path.name})"
    return default, "the demo's tuned window (docs/PERFORMANCE.md)"


def draft_step_row(session, prompt: list[int], k: int, length: int, tw: int, pairs: int) -> Row:
    """The draft's cost for one block at this context: recomputing its context K/V vs reading them cached."""
    import torch

    v, d = session.verifier, session.draft
    _, aux = v.forward(prompt, v.new_cache(), 0)
    feats = d.context_features(aux)
    n = feats.shape[0]
    cache = d.new_cache()
    d.extend_cache(cache, feats)
    pos = torch.arange(n)
    reps = 20

    def recompute() -> float:
        t0 = time.process_time()
        for _ in range(reps):
            d.draft(feats, pos, prompt[-1], n, k, with_confidence=False)
        return time.process_time() - t0

    def cached() -> float:
        t0 = time.process_time()
        for _ in range(reps):
            d.draft_cached(cache, prompt[-1], k, with_confidence=False)
        return time.process_time() - t0

    r = paired_ratios(recompute, cached, pairs)
    where = "short prompt" if length == 0 else f"{length // tw}x training length"
    return Row("draft KV cache", f"draft step cost at {n} context tokens ({where}): recompute / cached", r["ratio"],
               "x", notes=f"{spread(r)}; {1000 * r['baseline_s'] / reps:.2f} ms vs {1000 * r['subject_s'] / reps:.2f} ms "
                          f"per drafted block of {k}, no window")


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, help="a trained tiny run (checkpoints/checkpoint_best)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--multiples", default="2,4,8", help="long contexts, as multiples of the training length")
    ap.add_argument("--window", type=int, default=None, help="draft window (default: the run's tuned one, else 64)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--no-before", action="store_true", help="skip the uncached (before) side")
    args = ap.parse_args()
    import torch

    from dspark_kit.data.tiny_corpus import write_eval_prompts
    from dspark_kit.measure.eval_prompts import build_prompts, load_eval_prompts
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.specdec.checkpoints import resolve_checkpoint
    from dspark_kit.specdec.decoder import ReferenceDecoder, SpecGenerator
    from dspark_kit.specdec.window import LOCAL_KV_BLOCK_SIZE
    from dspark_kit.stages.evaluation.evaluate import EvalSession
    from dspark_kit.stages.prompts import prompt_source

    torch.set_num_threads(1)  # the local engine's default, and the least disturbed on a shared box
    recipe = load_recipe(RECIPE, ["train.device=cpu"])
    tmp = Path(tempfile.mkdtemp(prefix="bench-draft-kv-"))
    try:
        wd = trained_demo_run(args.workdir, tmp)
        res = Resolved(recipe, wd, checkpoint=resolve_checkpoint(wd / "checkpoints"))
        session = EvalSession(res, sweep=True)
        k, tw = session.draft.block_size, recipe.training_window
        window, window_src = (args.window, "--window") if args.window else tuned_window(wd, 64)
        chats = load_eval_prompts(prompt_source(res), session.tokenizer, write_eval_prompts(tmp / "prompts.jsonl", 32), limit=32).chats
        n, m = args.num_prompts, args.max_new_tokens
        alone = ReferenceDecoder(session.verifier)

        def decode_alone(p):
            return alone.generate(p, m, stop_ids=session.stop_ids)

        def spec(w, cached):
            g = SpecGenerator(session.verifier, session.draft, k, w, None, LOCAL_KV_BLOCK_SIZE, draft_kv_cache=cached)
            return lambda p: g.generate(p, m, stop_ids=session.stop_ids)

        lengths = [0, *(int(x) * tw for x in args.multiples.split(",") if x)]
        sides = [("after", True)] if args.no_before else [("before", False), ("after", True)]
        rows = []
        for length in lengths:
            prompts = build_prompts(session.tokenizer, chats, n, False, length)
            for w in [None] if length == 0 else [None, window]:
                for label, cached in sides:
                    fn = spec(w, cached)
                    fn(prompts[0])  # warm up (allocator, first-call paths) outside the timing
                    r = paired_ratios(lambda ps=prompts: timed(decode_alone, ps), lambda fn=fn, ps=prompts: timed(fn, ps),
                                      args.pairs)
                    where = "short prompts" if length == 0 else f"{length // tw}x training length ({length})"
                    goal, met = "", None
                    if label == "after" and length == 0:
                        goal, met = ">= 1.6x", r["ratio"] >= 1.6
                    elif label == "after" and w is not None:
                        goal, met = ">= 1.0x", r["ratio"] >= 1.0
                    rows.append(Row("draft KV cache", f"spec / verifier alone tokens/s, {where}, "
                                    f"window {w or 'off'}, {label}", r["ratio"], "x", goal, met,
                                    notes=f"{spread(r)}; verifier alone {r['baseline_s']:.2f}s, spec "
                                          f"{r['subject_s']:.2f}s for {n} prompts x {m} tokens; K={k}"
                                          + (f"; window {window} from {window_src}" if w else "")))
                    print(rows[-1].figure, f"{r['ratio']:.3f}", file=sys.stderr, flush=True)
            rows.append(draft_step_row(session, prompts[0], k, length, tw, args.pairs))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    emit(rows, args.json, this_command("bench_draft_kv.py", "--workdir WORKDIR" if args.workdir else ""))


if __name__ == "__main__":
    main()
