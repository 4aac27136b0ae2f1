"""`dspark-kit window tune` (in-process): sweep K x draft window over context lengths, recommend both.

sweep_rules.py decides the sweep's K values, candidate windows and long contexts (for this
in-process tune and `tune --served` alike) and picks a window from a table; `tune_window` measures each
point with evaluate.py's EvalSession and writes DIR/eval/window_tune.json, which
serve.num_speculative_tokens: auto and serve.draft_window_size: auto read through the resolver.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark_kit import atomic
from dspark_kit.measure.eval_prompts import build_prompts, eval_sizes, load_eval_prompts
from dspark_kit.measure.served_gate import checkpoint_identity
from dspark_kit.resolved import Resolved
from dspark_kit.specdec.window import LOCAL_KV_BLOCK_SIZE
from dspark_kit.stages.evaluation.evaluate import EvalSession, verify_budget
from dspark_kit.stages.evaluation.sweep_rules import pick_window, sweep_inputs
from dspark_kit.stages.prompts import prompt_source


def local_threshold_curve(session: EvalSession, prompts: list[list[int]], max_new: int, window: int | None, k: int,
                          log=lambda _msg: None) -> dict | None:
    """Acceptance and tokens/s against the confidence threshold, decoded in-process (None: no confidence
    head). A served engine's curve plugs in through measure.threshold_curve's PointMeasure."""
    from dspark_kit.measure.threshold_curve import threshold_curve

    if session.draft.model.confidence_head is None:
        return None

    def measure(t: float | None) -> dict:
        log(f"tune: K {k} window {window or 'off'} confidence threshold {t if t is not None else 'off'}")
        return session.measure(prompts, max_new, window, t, k)

    return threshold_curve(measure)


def tune_window(res: Resolved, *, candidates: list[int] | None = None, context_lengths: list[int] | None = None,
                ks: list[int] | None = None, allow_below: bool = False, num_prompts: int | None = None,
                max_new_tokens: int | None = None, prompts_file: Path | None = None, tolerance: float = 0.02,
                log=lambda _msg: None) -> dict:
    """Sweep K x draft window over context lengths; write DIR/eval/window_tune.json.

    serve.num_speculative_tokens: auto and serve.draft_window_size: auto read
    `recommended_k` and `recommended_window` from it (through the resolver).
    """
    recipe, tw = res.recipe, res.recipe.training_window
    ks, cands, ctx_lens = sweep_inputs(res, ks=ks, windows=candidates, context_lengths=context_lengths,
                                       allow_below=allow_below)
    session = EvalSession(res, sweep=True)
    sizes = eval_sizes(res.recipe, num_prompts, max_new_tokens)
    num_prompts, max_new = sizes.num_prompts, sizes.max_new_tokens
    found = load_eval_prompts(prompt_source(res), session.tokenizer, prompts_file, limit=max(num_prompts, 16))
    chats = found.chats
    thinking = recipe.measured_thinking
    prompt_sets = {0: build_prompts(session.tokenizer, chats, num_prompts, thinking)}
    prompt_sets |= {n: build_prompts(session.tokenizer, chats, num_prompts, thinking, n) for n in ctx_lens}
    tables: dict[int, dict[str, dict[str, float | None]]] = {}
    measurements = []
    short_runs: dict[tuple[int, int | None], dict] = {}  # (K, window) -> the short prompts' measure
    for k in ks:
        tables[k] = {}
        for w in [None, *cands]:
            key = str(w or "off")
            tables[k][key] = {}
            for n, prompts in prompt_sets.items():
                log(f"tune: K {k} window {key} context {n or 'short'}")
                m = session.measure(prompts, max_new, w, k=k)
                if n == 0:
                    short_runs[(k, w)] = m
                tables[k][key][str(n)] = m["acceptance_length"]
                measurements.append({"k": k, "window": w, "context_length": n,
                                     "mean_prompt_tokens": m["mean_prompt_tokens"],
                                     "acceptance_length": m["acceptance_length"]})
    by_k = {}
    for k, table in tables.items():
        w = pick_window(table, ctx_lens, tolerance)
        key = str(w or "off")
        by_k[k] = {"recommended_window": w, "mean_acceptance_length": round(
            sum((table[key][str(n)] or 1.0) for n in prompt_sets) / len(prompt_sets), 4)}
    best_k = max(ks, key=lambda k: (by_k[k]["mean_acceptance_length"], k))
    result = {
        "recommended_window": by_k[best_k]["recommended_window"],
        "recommended_k": best_k,
        "training_window": tw,
        "kv_block_size": LOCAL_KV_BLOCK_SIZE,
        "context_lengths": ctx_lens,
        "candidates": cands,
        "ks": ks,
        "by_k": {str(k): v for k, v in by_k.items()},
        "acceptance_length": tables[best_k],
        "acceptance_length_by_k": {str(k): t for k, t in tables.items()},
        "measurements": measurements,
        "num_prompts": num_prompts,
        "prompts": found.record(num_prompts),
        "checkpoint_identity": checkpoint_identity(session.checkpoint),  # which checkpoint was measured
        "max_new_tokens": max_new,
        "temperature": session.temperature,
        "checkpoint": str(session.checkpoint),
        "rule": f"per K: the window with max mean AL over contexts > window, short-context AL within {tolerance} "
                f"of no window, gain over no window > {tolerance}, else null (no window); then the K whose "
                "mean AL over all contexts (with its window) is highest",
    }
    best_w = result["recommended_window"]
    result["verify_budget"] = verify_budget(session, prompt_sets[0], max_new, best_w, best_k,
                                            fixed=short_runs.get((best_k, best_w)))
    result["threshold_curve"] = local_threshold_curve(session, prompt_sets[0], max_new, best_w, best_k, log)
    path = res.run.tune_file
    atomic.write_text(path, json.dumps(result, indent=2))
    result["file"] = str(path)
    return result
