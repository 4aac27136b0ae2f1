"""What the measuring stages ask the resolver for their prompts, once: measure/eval_prompts.py takes
the answer as plain values.

`prompt_source` is eval's prompt choice's record (the recipe, the run folder, the verifier's
tokenizer loaded only when a prompt must be compared with the training rows); `chosen_categories`
the prompt categories a measure runs (--categories, else the section's).

A floor of stages/ beside server_plan.py, above preflight/ and below the stage folders: it may import
stages/plan.py, stages/preflight/ and the layers below, never a stage folder.
"""

from __future__ import annotations

from dspark_kit.measure import eval_prompts
from dspark_kit.measure.eval_prompts import PromptSource
from dspark_kit.resolved import Resolved


def prompt_source(res: Resolved) -> PromptSource:
    """eval_prompts' record for `res`: its recipe and run folder; the tokenizer of its verifier path,
    resolved (built or converted) only when asked."""

    def load_tokenizer():
        from dspark_kit.specdec.verifier import load_tokenizer

        return load_tokenizer(res.verifier_path, res.recipe.verifier.trust_remote_code)

    return PromptSource(res.recipe, res.run, load_tokenizer)


def chosen_categories(res: Resolved, given: str | None, section: str) -> list[str]:
    """The prompt categories a measure runs: --categories, else `<section>.categories` (eval, bench),
    parsed (measure.eval_prompts.chosen_categories)."""
    return eval_prompts.chosen_categories(res.recipe, given, section)
