"""The anchor layout of a DSpark draft, decided here and nowhere else (docs/CONCEPTS.md#draft-layouts).

A block is `[anchor, MASK x (B-1)]` at positions p..p+B-1, and a draft is trained in one of two
layouts:

- **sample from the anchor** (`sample_from_anchor: true`; DeepSeek's releases, speculators'
  default): position p+k predicts token p+k+1, so a block gives B draft tokens;
- **bonus anchor** (false; DFlash's block layout, which SpecForge trains): the anchor is the bonus
  token, mask position p+k predicts token p+k, so a block gives B - 1.

Served in the other layout, a draft accepts almost nothing and nothing raises an error. Each
published layout (`layout_of`) has its loader, and they read a config without the key differently:

| layout | recognized by | a missing `sample_from_anchor` is read as |
|---|---|---|
| native (DeepSeek's) | `architectures` Qwen3DSparkModel / DSparkDraftModel, flat keys | true (vLLM's DSpark runtime) |
| speculators | `speculators_model_type: dspark` | false (vLLM's speculators loader) |
| specforge | `dflash_config.projector_type: dspark`, `auto_map` | true (SGLang, which serves them), though SpecForge trains false |
| sglang | `Qwen3DSparkModel` with a `dspark_config` block | true (SGLang) |

So what a draft was *trained* in is never taken from a loader's default: `anchor_layout` answers
with the config's own key, else the layout `dspark-kit import` measured or was told (recorded under
`dspark_kit_import.anchor`), else the layout's own convention where it has one (native: DeepSeek's
drafts sample from the anchor), else "unknown" (import then measures it). Every reader asks it: Resolved.k (the trained slots),
the engine gates, the served contract, import/export and the CLI. tests/test_anchor_rule.py fails
when another module reads the key with a default of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

KEY = "sample_from_anchor"
RECORD = "dspark_kit_import"  # what `dspark-kit import` recognized and measured (vLLM and SGLang ignore it)
LAYOUTS = ("native", "speculators", "specforge", "sglang")
NATIVE_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel")
# how each layout's loader reads a config without the key (the module doc's table)
_READ_WHEN_MISSING = {"native": True, "speculators": False, "specforge": True, "sglang": True}
# what a config without the key was trained in, where the layout itself says: DeepSeek's native
# drafts sample from the anchor by definition (speculators' config calls true "the DeepSeek/DeepSpec
# convention"); the others do not say (SpecForge trains false, speculators' loaders disagree)
_TRAINED_WHEN_MISSING = {"native": True}
# the layout the kit's own trainer writes (speculators' default), before any checkpoint exists
KIT_TRAINS = True


def layout_of(cfg: dict) -> str | None:
    """Which published layout a DSpark config is in, by that layout's own markers; None: not a
    DSpark draft the kit reads."""
    if cfg.get("speculators_model_type") == "dspark":
        return "speculators"
    archs = set(cfg.get("architectures") or ())
    flash = cfg.get("dflash_config")
    if isinstance(cfg.get("dspark_config"), dict) and "Qwen3DSparkModel" in archs:
        return "sglang"
    auto = cfg.get("auto_map")
    if (isinstance(flash, dict) and flash.get("projector_type") == "dspark") or \
            (isinstance(auto, dict) and any("DSparkDraftModel" in str(v) for v in auto.values())):
        return "specforge"
    if archs & set(NATIVE_ARCHS):
        return "native"
    return None


def block_size_of(cfg: dict) -> int | None:
    """The block as every loader finds it: `block_size`, `dspark_block_size`, then `dflash_config`'s."""
    for value in (cfg.get("block_size"), cfg.get("dspark_block_size"), (cfg.get("dflash_config") or {}).get("block_size")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def draft_tokens(block: int | None, sample_from_anchor: bool | None) -> int | None:
    """Draft tokens one block gives in a layout: B sampling from the anchor, B - 1 with a bonus anchor."""
    if block is None or sample_from_anchor is None:
        return None
    return block if sample_from_anchor else block - 1


@dataclass(frozen=True)
class Anchor:
    """A draft's anchor layout, as `anchor_layout` decides it."""

    layout: str | None
    sample_from_anchor: bool | None  # the layout it was trained in; None: unknown (measure it on import)
    source: str  # where that came from, for messages
    read_as: bool | None  # how its layout's loader reads the config (the key, else the loader's default)
    block_size: int | None
    slots: int | None  # draft tokens a block gives as trained (a recorded speculative_tokens wins)
    acceptance: dict | None = None  # the import's measurement: {"true": AL, "false": AL}

    @property
    def stated(self) -> bool:
        return self.source == "config"

    @property
    def known(self) -> bool:
        """Whether the layout it was trained in is known (stated, measured or told)."""
        return self.sample_from_anchor is not None

    def problem(self) -> str | None:
        """Why this draft cannot be served in its trained layout as it stands (None: it can): one line."""
        if not self.known:
            return (f"config.json has no {KEY}, and {self.layout or 'its'} loader would read it as "
                    f"{str(self.read_as).lower()}, which may not be how it was trained; `dspark-kit import` it "
                    f"(it measures the layout), or add the trained value (--{KEY.replace('_', '-')} true|false)")
        if self.acceptance and not self.stated_by_measurement_agrees():
            mine, other = self.acceptance[word(self.sample_from_anchor)], self.acceptance[word(not self.sample_from_anchor)]
            return (f"config.json sets {KEY} {word(self.sample_from_anchor)}, but `dspark-kit import` measured "
                    f"acceptance {mine:.3f} with it and {other:.3f} with {word(not self.sample_from_anchor)}: the "
                    f"draft was trained the other way; set \"{KEY}\": {word(not self.sample_from_anchor)} "
                    f"(re-import with --{KEY.replace('_', '-')} {word(not self.sample_from_anchor)})")
        return None

    def stated_by_measurement_agrees(self) -> bool:
        a = self.acceptance or {}
        mine, other = a.get(word(self.sample_from_anchor)), a.get(word(not self.sample_from_anchor))
        return not (isinstance(mine, (int, float)) and isinstance(other, (int, float)) and other > mine)


def word(value: bool | None) -> str:
    """true, false or unknown: how messages name an anchor layout."""
    return "unknown" if value is None else str(value).lower()


def _recorded_slots(cfg: dict) -> int | None:
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or []
    for m in methods:
        if isinstance(m, dict) and isinstance(m.get("speculative_tokens"), int):
            return m["speculative_tokens"]
    return None


def anchor_layout(cfg: dict, layout: str | None = None) -> Anchor:
    """THE rule: the anchor layout and slot count of a draft from its config and the layout it came
    in (`layout_of(cfg)` when not given); see the module doc."""
    layout = layout or layout_of(cfg)
    record = cfg.get(RECORD) if isinstance(cfg.get(RECORD), dict) else {}
    told = record.get("anchor") if isinstance(record.get("anchor"), dict) else {}
    stated = cfg.get(KEY)
    if isinstance(stated, bool):
        trained, source = stated, "config"
    elif isinstance(told.get("value"), bool):
        trained, source = told["value"], f"import ({told.get('source', 'recorded')})"
    elif layout in _TRAINED_WHEN_MISSING:
        trained, source = _TRAINED_WHEN_MISSING[layout], f"the {layout} layout's convention"
    else:
        trained, source = None, "unknown"
    read_as = stated if isinstance(stated, bool) else _READ_WHEN_MISSING.get(layout)
    block = block_size_of(cfg)
    slots = _recorded_slots(cfg)
    if slots is None:
        slots = draft_tokens(block, trained)
    acceptance = told.get("acceptance") if isinstance(told.get("acceptance"), dict) else None
    return Anchor(layout, trained, source, read_as, block, slots, acceptance)


def served_slots(cfg: dict, layout: str | None = None) -> int | None:
    """Draft tokens a block gives as the layout's loader reads the config (a missing key read its way)."""
    a = anchor_layout(cfg, layout)
    return draft_tokens(a.block_size, a.read_as)
