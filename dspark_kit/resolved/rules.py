"""The pure rules Resolved applies (also used on their own by the CLI), its Decision type and
the tune result it reads."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from dspark_kit.devices import npu_env, visible_devices_env
from dspark_kit.recipe import Recipe

T = TypeVar("T")
# The source of a K or window the tune chose ("auto: tuned ..."); the window warning keys on it.
TUNED = "auto: tuned"


class ResolveError(ValueError):
    """A derived value cannot be decided; one line naming the setting and the fix."""


@dataclass(frozen=True)
class Decision(Generic[T]):
    value: T
    source: str  # where the value came from, shown in dry runs, bench and the manifest
    notes: tuple[str, ...] = field(default=())  # warnings the user should see


# ---- pure rules (also used on their own by the CLI) ----------------------------


def long_context_note(recipe: Recipe, window: int | None) -> str | None:
    """Pitfall 10: served context far (> 2x) above the training window, nothing to bridge it."""
    max_len, train_w = recipe.serve.max_model_len, recipe.training_window
    if window is not None or max_len is None or max_len <= 2 * train_w or recipe.draft_has_sliding_layers:
        return None
    fix = ("set serve.draft_window_size" if recipe.serve.engine in ("vllm-ascend", "local")
           else "train a longer data.seq_length or sliding-window draft layers")
    return (f"serve.max_model_len {max_len} > 2x training window {train_w} with no draft window on engine "
            f"{recipe.serve.engine}: acceptance collapses on long contexts ({fix})")


def is_deepseek_v4(verifier_config: dict | None) -> bool:
    if not verifier_config:
        return False
    kinds = [verifier_config.get("model_type"), (verifier_config.get("text_config") or {}).get("model_type")]
    return any(isinstance(k, str) and k.startswith("deepseek_v4") for k in kinds)


def device_env(device: str, ids: str | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Env a process on `device` needs (training and serving alike): NPU defaults (HCCL etc.)
    unless the user's environment sets them, plus the visible-device variable the recipe names."""
    env = npu_env(os.environ if environ is None else environ) if device == "npu" else {}
    return {**env, **visible_devices_env(device, ids)}


@dataclass(frozen=True)
class Tune:
    """What `dspark-kit tune` recommended (DIR/eval/window_tune.json)."""

    path: Path
    window: int | None  # None: windows did not help, serve without one
    k: int | None  # None: the tune did not sweep K

    @classmethod
    def read(cls, path: Path) -> Tune | None:
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or "recommended_window" not in data:
                raise ValueError("no recommended_window")
        except (OSError, ValueError) as e:
            raise ResolveError(f"{path}: unreadable tune result ({str(e).splitlines()[0][:80]}); "
                               "re-run `dspark-kit tune` or delete the file") from None
        w, k = data.get("recommended_window"), data.get("recommended_k")
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ResolveError(f"{path}: recommended_window {w!r} is not a positive integer or null; "
                               "re-run `dspark-kit tune`")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ResolveError(f"{path}: recommended_k {k!r} is not a positive integer; re-run `dspark-kit tune`")
        return cls(path, w, k)
