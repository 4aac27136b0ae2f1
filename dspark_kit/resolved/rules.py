"""The pure rules Resolved applies (also used on their own by the CLI), its Decision type and
the tune result it reads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from dspark_kit.devices import device_env  # noqa: F401 - re-exported: it lives in devices.py (pure)
from dspark_kit.recipe import DTYPE_BYTES, Recipe
from dspark_kit.specdec.verifier_facts import language_model_config

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
    kinds = [verifier_config.get("model_type"), language_model_config(verifier_config).get("model_type")]
    return any(isinstance(k, str) and k.startswith("deepseek_v4") for k in kinds)


@dataclass(frozen=True)
class Tune:
    """What a tune recommended: `dspark-kit tune` (in-process acceptance, DIR/eval/window_tune.json)
    or `dspark-kit tune --served` (served throughput, DIR/eval/served_tune.json)."""

    path: Path
    window: int | None  # None: windows did not help, serve without one
    k: int | None  # None: the tune did not sweep K
    kind: str = "in-process"  # or "served"
    note: str | None = None  # what the user should know about this recommendation

    @classmethod
    def read(cls, path: Path) -> Tune | None:
        """The file's recommendation; None without the file (or a served tune that completed no point)."""
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not ({"recommended_window", "recommended"} & set(data)):
                raise ValueError("no recommendation")
        except (OSError, ValueError) as e:
            raise ResolveError(f"{path}: unreadable tune result ({str(e).splitlines()[0][:80]}); "
                               "re-run `dspark-kit tune` or delete the file") from None
        if "recommended" in data:
            return cls._served(path, data)
        return cls(path, _window(path, data.get("recommended_window")), _k(path, data.get("recommended_k")))

    @classmethod
    def _served(cls, path: Path, data: dict) -> Tune | None:
        rec, by_al, note = data.get("recommended"), data.get("recommended_by_acceptance"), None
        if isinstance(rec, dict) and rec.get("k") == 0:  # no speculation was fastest: serve role spec as
            note = (f"the served tune ({path}) measured the verifier alone fastest at concurrency "  # acceptance says
                    f"{data.get('concurrency')}: K and window follow its acceptance-only choice; serving "
                    "role chat is faster there")
            rec = by_al
        if rec is None:
            return None
        if not isinstance(rec, dict):
            raise ResolveError(f"{path}: recommended {rec!r} is not an object; re-run `dspark-kit tune --served`")
        return cls(path, _window(path, rec.get("window")), _k(path, rec.get("k")), "served", note)

    @classmethod
    def latest(cls, *paths: Path) -> Tune | None:
        """The most recent of the tune results (by the file's time) that recommends something."""
        found = [t for t in (cls.read(p) for p in sorted(paths, key=_mtime, reverse=True)) if t is not None]
        return found[0] if found else None


def _mtime(path: Path) -> float:
    return path.stat().st_mtime if path.is_file() else 0.0


def _window(path: Path, w) -> int | None:
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
        raise ResolveError(f"{path}: recommended window {w!r} is not a positive integer or null; "
                           "re-run `dspark-kit tune`")
    return w


def _k(path: Path, k) -> int | None:
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ResolveError(f"{path}: recommended K {k!r} is not a positive integer; re-run `dspark-kit tune`")
    return k


# ---- does the verifier fit the eval device? --------------------------------------

EVAL_DEVICES = ("auto", "cpu", "cuda", "npu")
# In-process eval holds the verifier's weights plus activations, its KV cache and the draft:
# weights x this much is the least the device must have.
EVAL_HEADROOM = 1.15


def check_eval_device(device: str) -> str:
    kind, sep, index = device.partition(":")
    if kind not in EVAL_DEVICES or (sep and (kind == "auto" or not index.isdigit())):
        raise ResolveError(f"--eval-device {device!r}: expected auto, cpu, cuda or npu (a device index as cuda:1)")
    return device


def eval_fit(params: int | None, dtype: str, device: str, memory: int | None, verifier: str) -> Decision[bool | None]:
    """Whether in-process eval can hold the verifier on `device` (None: cannot tell on this machine)."""
    if params is None:
        return Decision(None, f"verifier size unknown here (no readable config.json for {verifier})")
    need = params * DTYPE_BYTES[dtype] * EVAL_HEADROOM
    count = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    size = f"the verifier ({count} parameters) needs about {_bytes(need)} in {dtype}"
    if memory is None:
        return Decision(None, f"{size}; the memory of {device} cannot be read here")
    return Decision(need <= memory, f"{size} (weights + {EVAL_HEADROOM - 1:.0%}), {device} has {_bytes(memory)}")


def _bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def eval_mode(fit: Decision[bool | None], device: str) -> Decision[str]:
    """`run`'s eval stage: in-process when the verifier fits the eval device, else through the serving engine."""
    if fit.value is False:
        return Decision("served", f"the verifier does not fit {device}: {fit.source}")
    if fit.value is True:
        return Decision("in-process", f"the verifier fits {device}: {fit.source}")
    return Decision("in-process", f"{fit.source}; in-process unless the verifier proves too large where it runs")
