"""Installed-package versions and the engine gates that depend on them.

Nothing here imports vllm, vllm_ascend or torch_npu: versions come from
importlib.metadata and feature detection reads the installed source text, so
the checks run on a laptop with none of them installed ("unknown").
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dspark_kit.compat.engine_features import Features
from dspark_kit.compat.engine_table import (
    KIT_SAMPLE_FROM_ANCHOR,
    anchor_problem,
    first_serving,
    lookup,
)
from dspark_kit.devices import TRACKED_PACKAGES, tracked_version

TRACKED = tuple(TRACKED_PACKAGES)  # devices owns the list and the spellings

Support = Literal["yes", "no", "unknown"]


def installed(name: str) -> str | None:
    """Installed version of a tracked package (any of its spellings), or None when absent.

    Reads through devices.package_version, the one metadata reader (doctor and the
    manifest report the same numbers the gates here decide on).
    """
    return tracked_version(name)


@dataclass(frozen=True)
class Gate:
    ok: bool | None  # None: package not installed here, nothing to check
    message: str


# ---- what an engine release does with a DSpark draft ------------------------
# Every answer comes from engine_table (the surveyed releases, docs/COMPAT.md) or from the
# same detectors run over the installed engine's source: no version constants here.


def _package_parent(module: str) -> Path | None:
    # find_spec on a top-level name locates it without executing its __init__
    # (vllm_ascend's would import torch_npu).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def installed_features(engine: str) -> Features | None:
    """The detectors run over the installed engine (vllm-ascend: paired with the installed vLLM)."""
    from dspark_kit.compat.engine_features import ascend_features, vllm_features

    vllm_root, vllm_version = _package_parent("vllm"), installed("vllm")
    paired = vllm_features(vllm_root, vllm_version) if vllm_root and vllm_version else None
    if engine == "vllm":
        return paired
    root, version = _package_parent("vllm_ascend"), installed("vllm-ascend")
    if root is None or version is None:
        return None
    return ascend_features(root, version, paired)


@dataclass(frozen=True)
class EngineSupport:
    """What the engine that will serve does with a DSpark draft, and how the kit knows."""

    engine: str
    version: str | None  # None: not installed where the command is planned
    features: Features | None  # None: unknown
    source: str
    uncertain: tuple[str, ...] = ()  # features the table cannot place for this version

    def serves(self, sample_from_anchor: bool | None = KIT_SAMPLE_FROM_ANCHOR) -> Gate:
        """Can this engine serve a checkpoint trained with this sample_from_anchor (None: unknown)?"""
        pkg, f = self.engine, self.features
        if sample_from_anchor is None:  # no release can serve a layout nobody knows (specdec/anchor.py)
            return Gate(False, f"{pkg}: {anchor_problem('default-false', None)}")
        need = first_serving(pkg, sample_from_anchor)
        fix = f"{pkg}>={need} serves it" if need else f"no surveyed {pkg} release serves it"
        if self.version is None:
            return Gate(None, f"{pkg} is not installed here: the command needs {pkg} >= {need} on the "
                              "serving machine (docs/COMPAT.md)" if need else f"{pkg}: {fix}")
        if f is None:
            return Gate(None, f"{pkg} {self.version}: DSpark support unknown ({self.source}); "
                              f"{pkg} >= {need} is known to serve it (docs/COMPAT.md)")
        if not f.dspark:
            return Gate(False, f"{pkg} {self.version} lacks speculative method dspark ({self.source}); {fix}")
        problem = anchor_problem(f.anchor, sample_from_anchor)
        if problem:
            return Gate(False, f"{pkg} {self.version}: {problem} ({self.source}); {fix}")
        return Gate(True, f"{pkg} {self.version} serves DSpark ({self.source})")

    def has(self, feature: str) -> Support:
        """"yes"/"no"/"unknown" for "window" or "adaptive"."""
        if self.features is None or feature in self.uncertain:
            return "unknown"
        return "yes" if getattr(self.features, feature) else "no"

    def first_with(self, feature: str) -> str | None:
        return first_serving(self.engine, KIT_SAMPLE_FROM_ANCHOR, feature)


def engine_support(engine: str, version: str | None) -> EngineSupport:
    """The installed engine's own source when `version` is what is installed, else the table."""
    if engine not in ("vllm", "vllm-ascend"):
        raise ValueError(f"engine: {engine!r}; engine_support knows vllm and vllm-ascend")
    if version is None:
        return EngineSupport(engine, None, None, "not installed here")
    if installed(engine) == version:
        here = installed_features(engine)
        if here is not None:
            return EngineSupport(engine, version, here, "read from the installed source")
    found = lookup(engine, version)
    return EngineSupport(engine, version, found.features, found.source, found.uncertain)


# ---- num_speculative_tokens (K) vs the trained block ------------------------


@dataclass(frozen=True)
class KRule:
    """Which K an engine accepts for a DSpark draft with `slots` trained slots."""

    description: str
    allowed: Callable[[int, int], bool] = field(repr=False)  # (k, slots) -> ok

    def choose(self, recipe_k: int, slots: int) -> tuple[int, str | None]:
        """The recipe's K when allowed, else the nearest allowed K, plus a note."""
        if self.allowed(recipe_k, slots):
            return recipe_k, None
        candidates = [k for k in range(1, slots + 1) if self.allowed(k, slots)]
        if not candidates:
            return recipe_k, f"num_speculative_tokens {recipe_k}: no K works ({self.description})"
        k = min(candidates, key=lambda c: (abs(c - recipe_k), c))
        return k, f"num_speculative_tokens {recipe_k} -> {k}: {self.description}"


def k_rule(support: EngineSupport) -> KRule | None:
    """An engine's own rule for K on a speculators DSpark checkpoint, beyond the kit's one rule
    (1 <= K <= the trained slots: checkpoints.ks_outside_slots, a checkpoint finding); None: none.

    vLLM 0.26-0.27's "K >= dspark_block_size" guard reads a key a speculators config never
    carries (docs/COMPAT.md), so no surveyed release has one; a release whose loader passed that
    key on would be held to K = the slots."""
    f = support.features
    if f is not None and f.k_guard and f.k_guard in f.config_keys:
        return KRule(f"{support.engine} {support.version} refuses K < {f.k_guard} for DSpark",
                     lambda k, slots: k == slots)
    return None


# ---- speculators options that come and go between releases ------------------

OptionSupport = Literal["reads", "deprecated", "absent", "unknown"]
# where each speculators command keeps its options (under the installed package)
SPECULATORS_COMMANDS = {"train": "train", "generate-offline-data": "cli/generate_offline_data.py"}


@functools.cache
def _speculators_source(command: str) -> str | None:
    """The source text of a speculators command, read without importing speculators."""
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        return None
    where = Path(next(iter(spec.submodule_search_locations))) / SPECULATORS_COMMANDS[command]
    files = sorted(where.rglob("*.py")) if where.is_dir() else [where] if where.is_file() else []
    return "\n".join(p.read_text(errors="replace") for p in files) or None


def speculators_option(command: str, flag: str, source: str | None = None) -> OptionSupport:
    """Does the installed `speculators <command>` read `flag` (e.g. train's "--on-generate")?

    "deprecated": it still parses the flag but says it has no effect (speculators 0.9
    warns "--on-generate is deprecated and has no effect"), so passing it only adds a
    warning to every run; "absent": passing it would fail; "unknown": not installed here.
    """
    text = _speculators_source(command) if source is None else source
    if text is None:
        return "unknown"
    name = flag.lstrip("-")
    if f"--{name}" not in text and not re.search(rf"\b{name.replace('-', '_')}\b", text):
        return "absent"
    if re.search(rf"--{re.escape(name)}\b[^\n]{{0,40}}\bdeprecated\b", text, re.IGNORECASE):
        return "deprecated"
    return "reads"


def speculators_reads(command: str, flag: str) -> bool:
    """Pass `flag` to `speculators <command>`: it reads it (or speculators is not here to ask)."""
    return speculators_option(command, flag) in ("reads", "unknown")
