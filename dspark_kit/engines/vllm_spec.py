"""Spec-role decisions for vLLM / vLLM-Ascend: K and the draft KV window.

Both depend on the engine, its installed version and the draft's training, so
they live apart from the argv assembly in `engines.vllm` and are testable case
by case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dspark_kit.compat import versions
from dspark_kit.recipe import Recipe

TUNE_FILE = Path("eval") / "window_tune.json"


@dataclass
class WindowDecision:
    window: int | None  # draft_window_size to pass, None = omit
    notes: list[str] = field(default_factory=list)


def draft_has_sliding_layers(recipe: Recipe) -> bool:
    return recipe.draft.attention == "sliding" and len(recipe.full_attention_indices) < recipe.draft.num_layers


def tuned_window(workdir: Path) -> int | None:
    """`recommended_window` from `dspark-kit eval --tune-window`, if it ran."""
    path = workdir / TUNE_FILE
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get("recommended_window")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def is_deepseek_v4(verifier_config: dict | None) -> bool:
    if not verifier_config:
        return False
    kinds = [verifier_config.get("model_type"), (verifier_config.get("text_config") or {}).get("model_type")]
    return any(isinstance(k, str) and k.startswith("deepseek_v4") for k in kinds)


def decide_window(
    recipe: Recipe,
    engine: str,
    workdir: Path,
    method: str = "dspark",
    window_support: versions.Support = "unknown",
    verifier_config: dict | None = None,
) -> WindowDecision:
    """draft_window_size for a spec server, with a note for every rule that fired.

    Rules (REFERENCE §5): Ascend only (upstream vLLM has no runtime window; there
    it is trained in); never with MTP; W below the training window and windows
    on a natively trained DeepSeek-V4 DSpark draft lower acceptance; a
    vllm-ascend build without the DSpark apply point (PR 14596) would window
    the wrong table, so W is omitted there.
    """
    setting = recipe.serve.draft_window_size
    train_w = recipe.training_window
    notes: list[str] = []
    window: int | None = None

    if engine != "vllm-ascend":
        if isinstance(setting, int):
            notes.append(f"serve.draft_window_size {setting} ignored: CUDA vLLM has no runtime draft window "
                         "(train sliding-window draft layers instead)")
    elif setting == "off":
        pass
    elif method == "mtp":
        notes.append(f"serve.draft_window_size {setting} not passed: vllm-ascend forces the window off for "
                     "method mtp (it reuses the target's layers)")
    else:
        if isinstance(setting, int):
            window = setting
        else:  # auto: a tuned value beats the training-window floor
            tuned = tuned_window(workdir)
            window = tuned if tuned is not None else train_w
            src = f"{workdir / TUNE_FILE}" if tuned is not None else "the draft's training window"
            notes.append(f"draft_window_size auto -> {window} (from {src})")
        if window < train_w:
            notes.append(f"draft_window_size {window} < training window {train_w}: the draft saw longer "
                         "contexts in training; acceptance usually drops (set >= training window)")
        if method == "dspark" and is_deepseek_v4(verifier_config):
            notes.append("draft_window_size on a DSpark draft trained natively with a DeepSeek-V4 target: "
                         "vllm-ascend warns that windowing lowers its acceptance")
        if window_support == "no":
            notes.append(f"draft_window_size {window} omitted: the installed vllm-ascend does not apply the "
                         "window to DSpark (needs vllm-ascend PR 14596); upgrade to use it")
            window = None
        elif window_support == "unknown":
            notes.append("draft_window_size needs a vllm-ascend build with PR 14596 (DSpark window apply "
                         "point); could not check here because vllm-ascend is not installed")

    max_len = recipe.serve.max_model_len
    if window is None and max_len is not None and max_len > train_w and not draft_has_sliding_layers(recipe):
        notes.append(f"serve.max_model_len {max_len} > training window {train_w} and the draft has no "
                     "sliding-window layers: acceptance falls on long contexts"
                     + (" (set serve.draft_window_size)" if engine == "vllm-ascend" else
                        " (train longer data.seq_length or sliding-window draft layers)"))
    return WindowDecision(window, notes)


def choose_k(recipe: Recipe, engine: str, version: str | None, slots: int | None) -> tuple[int, list[str]]:
    """num_speculative_tokens for this engine version; notes when it differs or is unverified."""
    block = slots if slots is not None else recipe.draft.block_size
    rule = versions.k_rule(engine, version)
    k, note = rule.choose(recipe.num_speculative_tokens, block)
    return k, [note] if note else []
