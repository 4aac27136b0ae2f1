"""What `recipe show` prints under a recipe: the values the recipe implies, then every decided value.

The decided values are `Resolved.SUMMARY`, each with its source (`<name>_source`): the one list,
so `recipe show`, dry runs, plans and the manifest name the same values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dspark_kit.resolved import Resolved


def derived_values(res: Resolved) -> dict:
    r = res.recipe
    out: dict = {
        "workdir": str(res.run.root),
        "full_attention_indices": r.full_attention_indices,
        "training_window": r.training_window,
        "served_model_name": res.served_name,
        "hidden_states_served_model_names": res.served_names("hidden-states"),
        "checkpoint": str(res.checkpoint) + ("" if res.checkpoint_exists else " (not trained yet)"),
        "engine": res.engine,
    }
    for name, d in res.summary().items():
        if name != "engine":
            out[name], out[f"{name}_source"] = (d["value"], d["source"]) if "error" not in d else (None, d["error"])
    return out
