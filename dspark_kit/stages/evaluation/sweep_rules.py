"""The one rule for a K x window sweep's inputs, in-process (`tune`) and served (`tune --served`) alike:
the K values worth comparing, the candidate windows (multiples of the KV block they run at), the
long contexts, and how a window is picked from a measured table. Measures nothing, imports no model.
"""

from __future__ import annotations

from dspark_kit.measure.eval_prompts import EvalError
from dspark_kit.resolved import Resolved
from dspark_kit.specdec.checkpoints import ks_outside_slots, slots_error
from dspark_kit.specdec.window import LOCAL_KV_BLOCK_SIZE


def candidate_windows(training_window: int, max_context: int, block: int = LOCAL_KV_BLOCK_SIZE,
                      allow_below: bool = False) -> list[int]:
    """Multiples of the kernel block from the training window (or a quarter of it) up to the longest context."""
    floor = max(block, training_window // 4) if allow_below else training_window
    first = -(-floor // block) * block
    out, w = [], first
    while w < max_context:
        out.append(w)
        w *= 2
    return out or [first]


def candidate_ks(block_size: int, slots: int | None) -> list[int]:
    """K values worth comparing: block - 1 (the reference Ascend run's choice) and block (every trained slot)."""
    top = min(block_size, slots or block_size)
    both = {block_size - 1, block_size}
    return sorted(both - set(ks_outside_slots(both, top)))


def sweep_inputs(res: Resolved, *, ks: list[int] | None, windows: list[int] | None,
                 context_lengths: list[int] | None, allow_below: bool,
                 what: str = "tune", served: bool = False) -> tuple[list[int], list[int], list[int]]:
    """K values, candidate windows and long contexts of a sweep, in-process (`tune`) or served
    (`tune --served`) alike. None = the default; an empty window list sweeps K alone (window off).
    K is bounded by the slots the checkpoint trained (its config, else draft.block_size). Default
    windows are multiples of the KV block they run at: the serving engine's when served, else
    the local engine's (the in-process eval's)."""
    recipe = res.recipe
    block = (res.kv_block_size.value if served else None) or LOCAL_KV_BLOCK_SIZE
    tw = recipe.training_window
    ctx = sorted(set(context_lengths or recipe.eval.context_lengths or [2 * tw, 4 * tw, 8 * tw]))
    cands = sorted(set(windows if windows is not None else candidate_windows(tw, max(ctx), block, allow_below=allow_below)))
    below = [w for w in cands if w < tw]
    if below and not allow_below:
        raise EvalError(f"{what} --windows {below}: below the draft's training window {tw} "
                        "(pass --allow-below to try them anyway)")
    slots = res.trained_slots or recipe.draft.block_size
    ks = sorted(set(ks or candidate_ks(recipe.draft.block_size, res.trained_slots)))
    bad = ks_outside_slots(ks, slots)
    if bad:
        raise EvalError(slots_error(f"{what} --ks", bad, slots))
    return ks, cands, ctx


def pick_window(table: dict[str, dict[str, float | None]], context_lengths: list[int], tolerance: float) -> int | None:
    """The window with the best long-context AL that keeps short-context AL; None when windows do not help."""
    def al(key: str, n: int) -> float:
        return table[key].get(str(n)) or 1.0

    def long_mean(key: str) -> float:
        return sum(al(key, n) for n in context_lengths) / len(context_lengths)

    base_short, base_long = al("off", 0), long_mean("off")
    best, best_score = None, base_long + tolerance
    for key in table:
        if key == "off" or al(key, 0) < base_short - tolerance:
            continue
        if long_mean(key) > best_score:
            best, best_score = int(key), long_mean(key)
    return best
