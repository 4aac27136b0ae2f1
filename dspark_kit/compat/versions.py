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

from packaging.version import InvalidVersion, Version

from dspark_kit.devices import package_version

# distribution names as pip spells them, plus the spellings people type
_DIST_ALIASES = {
    "vllm": ("vllm",),
    "vllm-ascend": ("vllm-ascend", "vllm_ascend"),
    "torch": ("torch",),
    "torch-npu": ("torch-npu", "torch_npu"),
    "speculators": ("speculators",),
    "transformers": ("transformers",),
}
TRACKED = tuple(_DIST_ALIASES)

MIN_VLLM_DSPARK = "0.24"  # CUDA vLLM: first release with method "dspark"
MIN_VLLM_ASCEND_DSPARK = "0.24.0rc1"  # v0.23.x and below lack DSpark (docs/ASCEND.md)

# vLLM PR 47419 added a hard "num_speculative_tokens >= dspark_block_size" check to
# SpeculativeConfig (reported at v0.26.0 in vllm issue 50012, which disputes it);
# vllm main's vllm/config/speculative.py no longer carries it.
VLLM_K_GUARD_FROM = "0.26.0.dev0"
VLLM_K_GUARD_UNTIL = "0.27.0.dev0"

Support = Literal["yes", "no", "unknown"]


def _canonical(name: str) -> str:
    key = name.lower().replace("_", "-")
    if key not in _DIST_ALIASES:
        raise ValueError(f"versions: unknown package {name!r}; expected one of {', '.join(TRACKED)}")
    return key


def installed(name: str) -> str | None:
    """Installed version of a tracked package (any of its spellings), or None when absent.

    Reads through devices.package_version, the one metadata reader (doctor and the
    manifest report the same numbers the gates here decide on).
    """
    return next((v for dist in _DIST_ALIASES[_canonical(name)] if (v := package_version(dist))), None)


def parse(version: str) -> Version | None:
    try:
        return Version(version)
    except InvalidVersion:
        return None


def at_least(version: str | None, minimum: str) -> bool:
    """PEP 440 comparison, so pre-releases order correctly (0.24.0rc1 < 0.24.0).

    Local build tags (+cu130, +g1f486d9) are ignored; an unparseable or missing
    version is not "at least" anything.
    """
    v = parse(version) if version else None
    return v is not None and v >= Version(minimum)


@dataclass(frozen=True)
class Gate:
    ok: bool | None  # None: package not installed here, nothing to check
    message: str


def dspark_gate(engine: str, version: str | None) -> Gate:
    """Does this engine version serve method "dspark"?"""
    pkg, minimum = {
        "vllm": ("vllm", MIN_VLLM_DSPARK),
        "vllm-ascend": ("vllm-ascend", MIN_VLLM_ASCEND_DSPARK),
    }[engine]
    if version is None:
        return Gate(None, f"{pkg} is not installed here: command built for {pkg} >= {minimum} (DSpark)")
    if at_least(version, minimum):
        return Gate(True, f"{pkg} {version} >= {minimum}: DSpark supported")
    return Gate(False, f"{pkg} {version} < {minimum} lacks speculative method dspark; "
                       f"install {pkg}>={minimum} on the serving machine")


# ---- vllm-ascend DSpark draft window (PR 14596) -----------------------------

# The window lives in vllm_ascend/spec_decode/llm_base_proposer.py: it reads
# additional_config["draft_window_size"]. Before PR 14596 only dflash got
# future_offset 0 and the window was applied where DSpark's per-group block table
# later overwrites it; the PR names "dspark" at both places.
ASCEND_PROPOSER = Path("vllm_ascend") / "spec_decode" / "llm_base_proposer.py"
_DSPARK_WINDOW_MARKERS = (
    re.compile(r"future_offset\s*=.*[\"']dspark[\"']"),
    re.compile(r"draft_window_size.*[\"']dspark[\"']"),
)


def window_support_from_source(text: str) -> Support:
    """'yes' when the proposer source applies draft_window_size for DSpark."""
    if "draft_window_size" not in text:
        return "no"
    lines = text.splitlines()
    return "yes" if any(p.search(line) for p in _DSPARK_WINDOW_MARKERS for line in lines) else "no"


def _ascend_package_dir() -> Path | None:
    # find_spec on a top-level name locates it without executing its __init__
    # (which would import torch_npu).
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def ascend_dspark_window_support(package_root: Path | None = None) -> Support:
    """Does the installed vllm-ascend apply draft_window_size to DSpark drafts?"""
    root = package_root if package_root is not None else _ascend_package_dir()
    if root is None:
        return "unknown"
    src = root / ASCEND_PROPOSER
    if not src.is_file():
        # builds older than the spec_decode refactor have no window at all
        return "no" if (root / "vllm_ascend").is_dir() else "unknown"
    return window_support_from_source(src.read_text(errors="replace"))


# ---- num_speculative_tokens (K) vs the trained block ------------------------


@dataclass(frozen=True)
class KRule:
    """Which K an engine version accepts for a DSpark draft with `slots` trained slots."""

    description: str
    allowed: Callable[[int, int], bool] = field(repr=False)  # (k, block_size) -> ok
    known: bool = True  # False: version unknown, the recipe's K is kept as is

    def choose(self, recipe_k: int, block_size: int) -> tuple[int, str | None]:
        """The recipe's K when allowed, else the nearest allowed K, plus a note."""
        if not self.known:
            return recipe_k, f"num_speculative_tokens {recipe_k} kept: {self.description}"
        if self.allowed(recipe_k, block_size):
            return recipe_k, None
        candidates = [k for k in range(1, block_size + 1) if self.allowed(k, block_size)]
        if not candidates:
            return recipe_k, f"num_speculative_tokens {recipe_k}: no K works ({self.description})"
        k = min(candidates, key=lambda c: (abs(c - recipe_k), c))
        return k, f"num_speculative_tokens {recipe_k} -> {k}: {self.description}"


def _within_slots(k: int, block: int) -> bool:
    return 1 <= k <= block


def k_rule(engine: str, version: str | None) -> KRule:
    """K rule for method dspark, as the engine's speculative config enforces it.

    A speculators DSpark checkpoint (sample_from_anchor) has block_size trained
    slots, so K <= block_size everywhere; only vLLM 0.26.x also rejects K below it.
    """
    if engine == "vllm-ascend":
        return KRule("vllm-ascend has no lower bound on K (a reference run served K=7 for block 8); "
                     "K must not exceed the trained slots", _within_slots)
    if engine != "vllm":
        raise ValueError(f"engine: {engine!r}; k_rule knows vllm and vllm-ascend")
    if version is None or parse(version) is None:
        return KRule("installed vLLM version unknown; vLLM 0.26.x rejects K < block_size "
                     "(PR 47419 guard, disputed in issue 50012): set serve.num_speculative_tokens "
                     "= draft.block_size if vLLM raises 'Smaller values produce incorrect output'",
                     _within_slots, known=False)
    if not at_least(version, MIN_VLLM_DSPARK):
        return KRule(f"vLLM {version} has no method dspark (needs >= {MIN_VLLM_DSPARK})",
                     lambda k, b: False)
    if at_least(version, VLLM_K_GUARD_FROM) and not at_least(version, VLLM_K_GUARD_UNTIL):
        return KRule(f"vLLM {version} rejects num_speculative_tokens < block size for dspark "
                     "(PR 47419 guard, disputed in issue 50012); with block_size trained slots "
                     "that leaves K = block_size", lambda k, b: k == b)
    return KRule(f"vLLM {version}: no lower bound on K for dspark in its speculative config; "
                 "K must not exceed the trained slots", _within_slots)


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
