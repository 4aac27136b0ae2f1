"""The engine-compatibility table: one row per surveyed release, read by every gate.

`make compat` (`python -m dspark_kit.compat.engine_table`) asks the package index for
every release from MINIMUM on (engine_sources.index_versions: each one with a source
package, the newest included), fetches it, runs the detectors (engine_features) and writes
`engine_table.json` beside this file and docs/COMPAT.md from it. Nothing in the
kit keeps a version constant of its own: the minimum versions, the anchor rules
and the window and adaptive-verification support all come from these rows, or
from the same detectors run over an installed engine.

A version between two surveyed releases takes a feature only where both
neighbours agree; past the newest surveyed release it is assumed like the newest
(and the message says so).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from dspark_kit import atomic
from dspark_kit.compat.engine_features import (
    Features,
    ascend_features,
    paired_vllm_version,
    vllm_features,
)
from dspark_kit.specdec.anchor import (
    KIT_TRAINS as KIT_SAMPLE_FROM_ANCHOR,  # the kit trainer's layout
)

TABLE = Path(__file__).with_name("engine_table.json")
DOC = Path(__file__).resolve().parents[2] / "docs" / "COMPAT.md"
ENGINES = ("vllm", "vllm-ascend")
# the survey covers every release the index lists from these on (the last before DSpark included,
# so the table says where serving starts)
MINIMUM = {"vllm": "0.24.0", "vllm-ascend": "0.23.0"}


def _v(version: str) -> Version | None:
    try:
        return Version(version)
    except InvalidVersion:
        return None


@functools.cache
def rows(engine: str) -> tuple[Features, ...]:
    """The table's rows for one engine, oldest first."""
    data = json.loads(TABLE.read_text())
    found = [Features.from_row(r) for r in data["rows"] if r["engine"] == engine]
    return tuple(sorted(found, key=lambda f: _v(f.version)))


@dataclass(frozen=True)
class Lookup:
    features: Features | None  # None: unknown (not surveyed, unparseable, serving unclear)
    source: str  # where the answer came from, for messages
    uncertain: tuple[str, ...] = ()  # features the neighbouring releases disagree on


GATED = ("dspark", "anchor", "window", "adaptive")


def lookup(engine: str, version: str) -> Lookup:
    """A release's features from the table (see the module doc for versions it does not list)."""
    v = _v(version)
    table = rows(engine)
    if v is None or not table:
        return Lookup(None, f"{engine} {version}: not a version the table can place")
    base = Version(v.base_version) if v.local else v
    for f in table:
        if _v(f.version) == base:
            return Lookup(f, f"docs/COMPAT.md row {engine} {f.version}")
    below = [f for f in table if _v(f.version) < base]
    above = [f for f in table if _v(f.version) > base]
    if not below:
        first = table[0]
        known = first if not first.dspark else None
        return Lookup(known, f"older than the oldest surveyed {engine} {first.version}")
    if not above:
        return Lookup(below[-1], f"newer than the newest surveyed {engine} {below[-1].version}; assumed like it")
    lo, hi = below[-1], above[0]
    differ = tuple(name for name in GATED if getattr(lo, name) != getattr(hi, name))
    source = f"between surveyed {engine} {lo.version} and {hi.version}"
    if {"dspark", "anchor"} & set(differ):
        return Lookup(None, f"{source}, which differ in serving DSpark")
    return Lookup(lo, source, differ)


def anchor_problem(anchor: str, sample_from_anchor: bool | None) -> str | None:
    """Why an engine with this loader would serve the checkpoint in the wrong layout (None: fine).

    `sample_from_anchor` is the layout the checkpoint was trained in as specdec/anchor.py decides it
    (None: unknown, its config.json lacks the key)."""
    if anchor == "none":
        return "it has no speculators DSpark loader"
    if sample_from_anchor is None:
        return ("the checkpoint's config.json has no sample_from_anchor, so which layout it was trained in is "
                "unknown (this loader reads a missing key as false): add the trained value")
    if anchor == "forced-bonus" and sample_from_anchor:
        return ("its loader rewrites every speculators DSpark checkpoint to the bonus-anchor layout "
                "(sample_from_anchor ignored), so a draft trained with sample_from_anchor true is served "
                "shifted by one slot")
    return None


def serves(f: Features, sample_from_anchor: bool | None) -> bool:
    return f.dspark and anchor_problem(f.anchor, sample_from_anchor) is None


def first_serving(engine: str, sample_from_anchor: bool | None = KIT_SAMPLE_FROM_ANCHOR,
                  feature: str | None = None, table: list[Features] | None = None) -> str | None:
    """The oldest surveyed release from which every later one serves this layout (and has
    `feature`: "window" or "adaptive"); None when the newest does not. `table`: rows to read
    instead of the committed table (the survey, before it is written)."""
    found = rows(engine) if table is None else sorted((f for f in table if f.engine == engine),
                                                       key=lambda f: _v(f.version))
    out = None
    for f in reversed(found):
        if not serves(f, sample_from_anchor) or (feature and not getattr(f, feature)):
            break
        out = f.version
    return out


# ---- the survey (make compat) -------------------------------------------------


def releases(list_versions=None) -> dict[str, tuple[str, ...]]:
    """Per engine, the releases the index lists from MINIMUM on, oldest first. `list_versions`
    (dist -> versions; default: engine_sources.index_versions) raises SourceError when no index
    answers."""
    from dspark_kit.compat import engine_sources

    list_versions = list_versions or engine_sources.index_versions
    out = {}
    for engine in ENGINES:
        found = {v for v in list_versions(engine) if _v(v) is not None and _v(v) >= Version(MINIMUM[engine])}
        out[engine] = tuple(sorted(found, key=_v))
    return out


def survey(fetch=None, log=print, wanted: dict[str, tuple[str, ...]] | None = None) -> list[Features]:
    """Fetch every release in `wanted` (default: the index's, `releases()`) and run the detectors."""
    from dspark_kit.compat import engine_sources

    fetch = fetch or engine_sources.fetch
    wanted = wanted if wanted is not None else releases()
    by_version: dict[str, Features] = {}
    out: list[Features] = []
    for version in wanted["vllm"]:
        root = fetch("vllm", version)
        by_version[version] = f = vllm_features(root, version)
        out.append(f)
        log(f"vllm {version}: dspark={f.dspark} anchor={f.anchor} adaptive={f.adaptive} draft_topk={f.draft_topk}")
    for version in wanted["vllm-ascend"]:
        root = fetch("vllm-ascend", version)
        paired_version = paired_vllm_version(root)
        paired = None
        if paired_version:
            paired = by_version.get(paired_version) or vllm_features(fetch("vllm", paired_version), paired_version)
        f = ascend_features(root, version, paired, paired_version)
        out.append(f)
        log(f"vllm-ascend {version} (vLLM {paired_version}): dspark={f.dspark} anchor={f.anchor} "
            f"window={f.window} adaptive={f.adaptive}")
    return out


def missing_releases(listed: dict[str, tuple[str, ...]]) -> list[str]:
    """"<engine> <version>" for each release the index lists that the committed table lacks."""
    return [f"{e} {v}" for e in ENGINES for v in listed.get(e, ())
            if v not in {f.version for f in rows(e)}]


def table_json(found: list[Features]) -> str:
    return json.dumps({"rows": [f.as_row() for f in found]}, indent=1) + "\n"


ANCHOR_WORDS = {
    "forced-bonus": "rewrites to bonus-anchor (key ignored)",
    "default-false": "reads the key; missing = false",
    "default-true": "reads the key; missing = true",
    "none": "-",
}


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def markdown(found: list[Features]) -> str:
    """docs/COMPAT.md: the rows as tables, and the minimum versions the gates derive from them."""
    by_engine = {e: sorted((f for f in found if f.engine == e), key=lambda f: _v(f.version)) for e in ENGINES}
    lines = [
        "# Engine compatibility",
        "",
        "Generated by `make compat` from the released source packages on the package index: each",
        "release is fetched, unpacked and read by the kit's own detectors (`dspark_kit/compat/engine_features.py`).",
        "Do not edit by hand: the gates in `serve`, `run` and `preflight` read the same rows",
        "(`dspark_kit/compat/engine_table.json`), and planning runs the same detectors over an installed engine.",
        "",
        "Columns:",
        "- **DSpark**: serves `--speculative-config '{\"method\":\"dspark\",...}'` (for vllm-ascend: its own",
        "  proposer on a paired vLLM that has the method; the pairing is the release's `vllm-release-tag`).",
        "- **sample_from_anchor**: what vLLM's speculators-config loader does with the checkpoint key. The kit",
        "  trains with `sample_from_anchor: true` (speculators' default) and writes the key.",
        "- **K guard**: vLLM's `DSpark requires num_speculative_tokens >= <key>` check and the config key it",
        "  reads; a speculators checkpoint never carries `dspark_block_size`, so that guard does not apply to it.",
        "- **window**: vllm-ascend applies `draft_window_size` to DSpark drafts (vllm-ascend PR 14596).",
        "- **adaptive**: vLLM's `enable_adaptive_verification` (speculative config) or vllm-ascend's",
        "  `dynamic_spec_config` with method `dspark` (additional config); both size the verify budget from",
        "  the draft's confidence head.",
        "- **draft_topk**: the speculative config takes `dspark_draft_topk` for DSpark (the kit's",
        "  `serve.draft_topk`; 1..the draft vocabulary).",
        "- **checks draft weights**: the DSpark model refuses a reduced-vocabulary draft without `lm_head`/`d2t`",
        "  and an expanded-vocabulary one without `embed_tokens`, and turns the confidence head off when its",
        "  weights are missing. Where it does not, such a draft loads silently; the kit's checkpoint findings",
        "  refuse it on every release.",
        "- Speculative-config keys: vLLM's config classes refuse unknown keys at start-up; the notes name the",
        "  keys each release added or removed, and the kit only writes keys the serving release takes.",
        "",
    ]
    for engine in ENGINES:
        fs = by_engine[engine]
        if not fs:
            continue
        paired = engine == "vllm-ascend"
        lines += [f"## {engine}", "",
                  "| release | " + ("vLLM | " if paired else "") + "DSpark | sample_from_anchor | "
                  + ("" if paired else "K guard | ") + "window | adaptive | draft_topk | checks draft weights | "
                  "serves a kit checkpoint |",
                  "|---|" + ("---|" if paired else "") + "---|---|" + ("" if paired else "---|") + "---|---|---|---|---|"]
        for f in fs:
            guard = f"K >= `{f.k_guard}`" if f.k_guard else "-"
            cells = [f.version, *([f.paired_vllm or "?"] if paired else []), _yes(f.dspark), ANCHOR_WORDS[f.anchor],
                     *([] if paired else [guard]), _yes(f.window) if paired else "n/a (no runtime window)",
                     _yes(f.adaptive), _yes(f.draft_topk), _yes(f.weight_checks) if f.dspark else "-",
                     _yes(serves(f, KIT_SAMPLE_FROM_ANCHOR))]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        notes = [(f.version, n) for f in fs for n in f.notes]
        if not paired:
            notes = sorted(notes + key_changes(fs), key=lambda n: _v(n[0]))
        if notes:
            lines += [f"- {v}: {n}" for v, n in notes] + [""]
        keys = fs[-1].config_keys
        if keys:
            lines += [f"Config keys the DSpark loader reads ({engine} {fs[-1].version}): "
                      + ", ".join(f"`{k}`" for k in keys), ""]
    lines += ["## What the gates derive", "",
              "| engine | serves a kit checkpoint from | DSpark window from | adaptive verification from |",
              "|---|---|---|---|"]
    for engine in ENGINES:
        lines.append(f"| {engine} | {_derived(found, engine)} | {_derived(found, engine, 'window')} | "
                     f"{_derived(found, engine, 'adaptive')} |")
    lines += ["", "A checkpoint without `sample_from_anchor` in its config.json is refused on every release: the",
              "layout it was trained in is unknown, and serving the other one accepts almost nothing",
              "(`dspark-kit import` measures it; CONCEPTS.md, draft layouts).", ""]
    return "\n".join(lines)


def key_changes(fs: list[Features]) -> list[tuple[str, str]]:
    """(version, note) for each speculative-config key a release added or removed (vLLM rows,
    oldest first): a removed key fails at start-up from that release on."""
    out = []
    for prev, f in itertools.pairwise(fs):
        if not prev.spec_keys or not f.spec_keys:
            continue
        added = sorted(set(f.spec_keys) - set(prev.spec_keys))
        removed = sorted(set(prev.spec_keys) - set(f.spec_keys))
        parts = []
        if added:
            parts.append("speculative config adds " + ", ".join(f"`{k}`" for k in added))
        if removed:
            parts.append("refuses the removed keys " + ", ".join(f"`{k}`" for k in removed))
        if parts:
            out.append((f.version, "; ".join(parts)))
    return out


def _derived(found: list[Features], engine: str, feature: str | None = None) -> str:
    if feature == "window" and engine == "vllm":
        return "n/a"
    return first_serving(engine, KIT_SAMPLE_FROM_ANCHOR, feature, found) or "none surveyed"


def main(argv: list[str] | None = None, list_versions=None, fetch=None) -> int:
    """`list_versions` / `fetch`: stand-ins for the package index (tests)."""
    from dspark_kit.compat.engine_sources import SourceError

    ap = argparse.ArgumentParser(prog="python -m dspark_kit.compat.engine_table",
                                 description="Survey every vLLM / vllm-ascend release the package index lists "
                                             "from their source packages and write the engine-compatibility "
                                             "table (make compat).")
    ap.add_argument("--check", action="store_true",
                    help="do not write: warn naming each release the index lists that the table lacks; exit 1 "
                         "if the committed table or docs/COMPAT.md differ from the survey of the table's releases; "
                         "pass, saying so, when no index is reachable")
    args = ap.parse_args(argv)
    try:
        listed = releases(list_versions)
    except SourceError as e:
        if args.check:
            print(f"compat: no package index reachable ({e}); the table was not checked against it")
            return 0
        print(f"compat: {e}", file=sys.stderr)
        return 1
    if args.check:  # the table's own releases again; the index's new ones only named
        for name in missing_releases(listed):
            print(f"compat: warning: the index lists {name}, which docs/COMPAT.md lacks (run make compat)",
                  file=sys.stderr)
        listed = {e: tuple(f.version for f in rows(e)) for e in ENGINES}
    try:
        found = survey(fetch, wanted=listed)
    except SourceError as e:
        print(f"compat: {e}", file=sys.stderr)
        return 1
    new_table, new_doc = table_json(found), markdown(found)
    if args.check:
        stale = [str(p) for p, text in ((TABLE, new_table), (DOC, new_doc))
                 if not p.is_file() or p.read_text() != text]
        if stale:
            print(f"compat: out of date with the survey: {', '.join(stale)} (run make compat)", file=sys.stderr)
            return 1
        print(f"compat: {len(found)} releases, table and docs/COMPAT.md up to date")
        return 0
    atomic.write_text(TABLE, new_table)
    atomic.write_text(DOC, new_doc)
    rows.cache_clear()
    print(f"compat: {len(found)} releases -> {TABLE.name}, {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
