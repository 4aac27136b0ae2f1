"""A DSpark draft in each published layout <-> the speculators layout the kit trains, evaluates and
serves: `dspark-kit import` / `export` (docs/CONCEPTS.md#draft-layouts).

specdec/anchor.py recognizes the layouts (`layout_of`) and decides the anchor layout; this module
moves the keys. The layouts, as their loaders read them:

- **native** (DeepSeek's `deepseek-ai/dspark_*`; vLLM 0.34.0's qwen3_dspark.py): a Qwen3 config
  with architectures `Qwen3DSparkModel` (or `DSparkDraftModel`), the DSpark keys at the top:
  `block_size` (else `dspark_block_size`), zero-based `target_layer_ids` (`dflash_config`'s, then
  `dspark_target_layer_ids`, take precedence), `mask_token_id` (`dflash_config` first), the Markov
  and confidence keys, `draft_vocab_size`, `target_hidden_size`, `sample_from_anchor`.
- **speculators** (what the kit trains; RedHatAI's releases): `speculators_model_type: dspark`, the
  Qwen3 part under `transformer_layer_config` (sliding-window `layer_types` and `sliding_window`
  included), `aux_hidden_state_layer_ids` = target_layer_ids + 1, `speculators_config`.
- **specforge** (SpecForge's `configs/*-dspark.json`): `DSparkDraftModel`, `auto_map`, flat Qwen3
  keys, and a `dflash_config` holding `target_layer_ids`, `mask_token_id`, `projector_type: dspark`
  and the Markov and confidence keys; no `sample_from_anchor` (import measures it) and no
  `draft_vocab_size`: the full vocabulary, `vocab_size`, as SpecForge trains (a missing
  `draft_vocab_size` reads so in every layout).
- **sglang** (SGLang's DSpark loader, `dspark_config.py`; speculators issue 753): `Qwen3DSparkModel`,
  the layer config flattened, the DSpark keys at the top *and* copied into `dflash_config` and
  `dspark_config` blocks (SGLang reads `dspark_config`, then `dflash_config`, then the top level),
  `target_layer_ids` = aux - 1.

Import keeps every key: a released config is recorded whole under `dspark_kit_import.config`
beside the layout it was recognized in and how its anchor layout was decided; a field the kit does
not read comes back as one note naming it. Export carries the speculators-only keys under
`dspark_kit_speculators` (vLLM and SGLang ignore it), so export then import gives back the same
config.json. Tensors are copied byte for byte: every loader reads the same names (vLLM and SGLang
add or strip the `model.` prefix themselves).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from dspark_kit.specdec.anchor import (
    KEY,
    NATIVE_ARCHS,
    RECORD,
    anchor_layout,
    draft_tokens,
    layout_of,
)
from dspark_kit.specdec.checkpoints import CONFIG, WEIGHTS

__all__ = ["LayoutError", "export_draft", "import_draft", "layout_of", "to_native", "to_sglang", "to_speculators"]

SPECULATORS_ARCH = "DSparkSpeculator"
CARRY = "dspark_kit_speculators"
EXPORTS = ("native", "sglang")
# DSpark keys that sit at the top level in the native layout and in speculators'
SHARED = ("draft_vocab_size", "target_hidden_size", "mask_token_id", "markov_rank", "markov_head_type",
          "enable_confidence_head", "confidence_head_with_markov", "block_size", KEY)
# keys of a native config that are DSpark's, not the Qwen3 layer config's
NATIVE_ONLY = ("architectures", "target_layer_ids", "dspark_target_layer_ids", "dspark_block_size",
               "dflash_config", "dspark_config", "auto_map", RECORD, CARRY)
# what SpecForge and SGLang nest in dflash_config / dspark_config that the kit reads
NESTED = ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type",
          "enable_confidence_head", "confidence_head_with_markov")
# nested keys the kit understands but does not serve with: a training weight, layout markers
NESTED_TRAINING = ("projector_type", "confidence_head_alpha", "mask_token", "num_target_layers")
# the DSpark keys SGLang's export copies into both blocks (speculators issue 753)
SGLANG_BLOCK = ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type",
                "enable_confidence_head", "confidence_head_with_markov")


class LayoutError(ValueError):
    """One line naming the draft, the key and the fix."""


def _nested(cfg: dict, key: str):
    """A DSpark key from the blocks, as SGLang reads them: `dspark_config`, then `dflash_config`."""
    for block in ("dspark_config", "dflash_config"):
        inner = cfg.get(block)
        if isinstance(inner, dict) and key in inner:
            return inner[key]
    return None


def _target_layer_ids(cfg: dict, where: str) -> list[int]:
    for value in (_nested(cfg, "target_layer_ids"), cfg.get("dspark_target_layer_ids"), cfg.get("target_layer_ids")):
        if value:
            if not all(isinstance(i, int) for i in value):
                raise LayoutError(f"{where}: target_layer_ids {value} are not layer numbers")
            return list(value)
    raise LayoutError(f"{where}: no target_layer_ids (nor dflash_config.target_layer_ids): the draft does not "
                      "say which verifier layers feed it")


def _known_layer_keys() -> set[str]:
    from transformers import Qwen3Config

    return set(Qwen3Config().to_dict()) | {"rope_theta", "rope_scaling", "torch_dtype", "auto_map"}


def unknown_fields(cfg: dict, layout: str) -> list[str]:
    """One note per config field the kit does not read (kept as it was, never dropped silently)."""
    known = _known_layer_keys() | set(SHARED) | set(NATIVE_ONLY)
    notes = []
    if layout == "speculators":
        from speculators.models.dspark import DSparkSpeculatorConfig

        known |= set(DSparkSpeculatorConfig.model_fields) | {"transformers_version", "auto_map"}
        layer = cfg.get("transformer_layer_config") or {}
        notes += [f"transformer_layer_config.{k}" for k in sorted(layer) if k not in _known_layer_keys()]
    notes = [k for k in sorted(cfg) if k not in known] + notes
    for block in ("dflash_config", "dspark_config"):
        inner = cfg.get(block)
        if isinstance(inner, dict):
            notes += [f"{block}.{k}" for k in sorted(inner) if k not in NESTED and k not in NESTED_TRAINING]
    return [f"config field {name}: not one the kit reads; kept as it was (under {RECORD}.config)" for name in notes]


def to_speculators(native: dict, verifier: str, verifier_architectures: list[str] | None = None,
                   where: str = "draft", sample_from_anchor: bool | None = None) -> dict:
    """The speculators config of a draft in the native, SpecForge or SGLang layout (the kit's
    layout), `sample_from_anchor` written as decided (the config's own value when not given)."""
    carry = native.get(CARRY) if isinstance(native.get(CARRY), dict) else {}
    block = native.get("block_size", native.get("dspark_block_size", _nested(native, "block_size")))
    if not isinstance(block, int) or block < 1:
        raise LayoutError(f"{where}: no block_size (nor dspark_block_size) in {CONFIG}")
    mask = _nested(native, "mask_token_id")
    mask = native.get("mask_token_id") if mask is None else mask
    if not isinstance(mask, int):
        raise LayoutError(f"{where}: no mask_token_id (nor dflash_config.mask_token_id) in {CONFIG}")
    if sample_from_anchor is None:
        sample_from_anchor = anchor_layout(native).sample_from_anchor
    if sample_from_anchor is None:
        raise LayoutError(f"{where}: {CONFIG} does not say its anchor layout (no {KEY}); pass "
                          "--sample-from-anchor true|false, or a local --verifier to measure it")
    layer = {k: v for k, v in native.items() if k not in NATIVE_ONLY and k not in SHARED}
    if "layer_architectures" in carry:
        layer["architectures"] = carry["layer_architectures"]
    derived = {k: native[k] for k in SHARED if k in native}
    derived |= {k: v for k in NESTED if k in SHARED and (v := _nested(native, k)) is not None}
    _full_vocabulary(derived, native.get("vocab_size"))
    derived |= {"transformer_layer_config": layer, "block_size": block, "mask_token_id": mask,
                "aux_hidden_state_layer_ids": [i + 1 for i in _target_layer_ids(native, where)],
                KEY: bool(sample_from_anchor)}
    if carry.get("speculators"):
        return {**derived, **carry["speculators"]}
    return {"architectures": [SPECULATORS_ARCH], "speculators_model_type": "dspark",
            "speculators_config": {
                "algorithm": "dspark",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft_tokens(block, bool(sample_from_anchor)),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier,
                             "architectures": verifier_architectures or []}},  # speculators' own default
            **derived}


def _full_vocabulary(cfg: dict, vocab_size) -> None:
    """A draft whose config has no draft_vocab_size drafts over the full vocabulary (SpecForge's
    configs carry only vocab_size, and SpecForge trains the full vocabulary): written explicitly, as
    speculators otherwise builds its Markov head with its own default of 32,000 rows."""
    if cfg.get("draft_vocab_size") is None and isinstance(vocab_size, int):
        cfg["draft_vocab_size"] = vocab_size


def to_native(spec: dict, where: str = "checkpoint") -> dict:
    """The native layout of a speculators DSpark checkpoint, with what only speculators records
    carried under `dspark_kit_speculators` (vLLM ignores it; import restores it)."""
    layer = spec.get("transformer_layer_config")
    if not isinstance(layer, dict) or not layer:
        raise LayoutError(f"{where}: no transformer_layer_config in {CONFIG}; re-save it from the trainer")
    aux = spec.get("aux_hidden_state_layer_ids")
    if not aux:
        raise LayoutError(f"{where}: no aux_hidden_state_layer_ids in {CONFIG}; re-save it from the trainer")
    anchor = anchor_layout(spec)
    if anchor.sample_from_anchor is None:
        raise LayoutError(f"{where}: {anchor.problem()}")
    native = {k: v for k, v in layer.items() if k != "architectures"}
    native["architectures"] = [NATIVE_ARCHS[0]]
    native |= {k: spec[k] for k in SHARED if k in spec}
    native[KEY] = anchor.sample_from_anchor  # explicit: each loader reads a missing key its own way
    native["target_layer_ids"] = [i - 1 for i in aux]
    derived = {"transformer_layer_config", "aux_hidden_state_layer_ids", *SHARED}
    native[CARRY] = {"speculators": {k: v for k, v in spec.items() if k not in derived}}
    if "architectures" in layer:
        native[CARRY]["layer_architectures"] = layer["architectures"]
    return native


def to_sglang(spec: dict, where: str = "checkpoint") -> dict:
    """SGLang's layout of a speculators DSpark checkpoint: the native one, with the DSpark keys also
    in `dflash_config` and `dspark_config` (SGLang reads the blocks first)."""
    native = to_native(spec, where)
    blocks = {k: native[k] for k in SGLANG_BLOCK if k in native}
    native["dflash_config"] = dict(blocks)
    native["dspark_config"] = dict(blocks)
    return native


def _read(src: Path) -> dict:
    try:
        return json.loads((src / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LayoutError(f"{src}: cannot read {CONFIG} ({e})") from None


def _check_weights(src: Path) -> None:
    if not (src / WEIGHTS).is_file():
        shards = sorted(p.name for p in src.glob("*.safetensors"))
        why = f"sharded weights ({', '.join(shards[:3])}...)" if shards else f"no {WEIGHTS}"
        raise LayoutError(f"{src}: {why}; the kit reads a draft saved as one {WEIGHTS}")


def write_draft(dest: Path, cfg: dict, src: Path, link: bool = False) -> Path:
    """config.json + the weights byte for byte (`link`: a symlink, for a throwaway candidate), into
    a temp folder renamed to `dest`."""
    if dest.exists():
        raise LayoutError(f"{dest} exists; pass a new folder")
    _check_weights(src)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        # as transformers' save_pretrained writes a config (sorted keys, indent 2)
        (tmp / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if link:
            (tmp / WEIGHTS).symlink_to((src / WEIGHTS).resolve())
        else:
            shutil.copyfile(src / WEIGHTS, tmp / WEIGHTS)
        if (src / "config.py").is_file():  # speculators' config class beside its config (auto_map)
            shutil.copyfile(src / "config.py", tmp / "config.py")
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _from_speculators_release(cfg: dict, verifier: str, where: str) -> dict:
    """A released speculators-layout draft as the kit keeps one: its keys as they are, the verifier
    the user names (the release's own is kept in the record)."""
    for key in ("transformer_layer_config", "aux_hidden_state_layer_ids", "block_size", "mask_token_id"):
        if not cfg.get(key) and cfg.get(key) != 0:
            raise LayoutError(f"{where}: no {key} in {CONFIG}; not a complete speculators DSpark draft")
    out = json.loads(json.dumps(cfg))
    _full_vocabulary(out, (out.get("transformer_layer_config") or {}).get("vocab_size"))
    spec = out.setdefault("speculators_config", {})
    spec.setdefault("verifier", {})["name_or_path"] = verifier
    return out


def import_draft(src: Path, dest: Path, verifier: str, verifier_architectures: list[str] | None = None,
                 sample_from_anchor: bool | None = None, measure=None) -> tuple[dict, dict]:
    """A DSpark draft in any published layout -> the speculators layout in `dest`.

    The anchor layout: the config's key; else `sample_from_anchor` (forced); else `measure`d:
    `measure({True: dir, False: dir})` -> {"true": AL, "false": AL}, decoding with each candidate
    (also run when forced, so a forced layout that measures worse is recorded and refused at
    preflight). Returns (the written config, a report: layout, anchor record, notes)."""
    src, dest = Path(src), Path(dest)
    cfg = _read(src)
    where = f"import {src}"
    layout = layout_of(cfg)
    if layout is None:
        raise LayoutError(f"{where}: not a DSpark draft (architectures {cfg.get('architectures')}, expected one of "
                          f"{', '.join(NATIVE_ARCHS)}, speculators_model_type dspark, or a dflash_config with "
                          "projector_type dspark)")
    if layout == "speculators" and isinstance(cfg.get(RECORD), dict):
        raise LayoutError(f"{where}: already imported (it records {RECORD}); serve or train from it as is")
    _check_weights(src)
    notes = unknown_fields(cfg, layout)
    said = anchor_layout(cfg, layout)
    from_kit = isinstance(cfg.get(CARRY), dict)  # the kit's own export: restored as it was
    base = _from_speculators_release(cfg, verifier, where) if layout == "speculators" else None

    def candidate(value: bool) -> dict:
        if base is not None:  # the release's K, within the slots of the layout it is read in
            out = json.loads(json.dumps({**base, KEY: value}))
            slots = draft_tokens(anchor_layout(out).block_size, value)
            for m in out["speculators_config"].get("proposal_methods") or []:
                if isinstance(m, dict) and isinstance(m.get("speculative_tokens"), int) and slots is not None:
                    m["speculative_tokens"] = min(m["speculative_tokens"], slots)
            return out
        return to_speculators(cfg, verifier, verifier_architectures, where, sample_from_anchor=value)

    candidate(True)  # a draft that cannot be converted fails here, before anything is decoded
    if not said.known and sample_from_anchor is None and measure is None:
        raise LayoutError(f"{where}: {CONFIG} does not say its anchor layout (no {KEY}) and no verifier is at hand "
                          "to measure it; pass --sample-from-anchor true|false")
    acceptance = None
    if measure is not None and not from_kit and (not said.known or sample_from_anchor is not None):
        with tempfile.TemporaryDirectory(prefix=".measure-", dir=dest.parent if dest.parent.exists() else None) as t:
            dirs = {v: write_draft(Path(t) / str(v).lower(), candidate(v), src, link=True) for v in (True, False)}
            try:
                acceptance = measure(dirs)
            except LayoutError:
                raise
            except Exception as e:  # noqa: BLE001 - a draft that does not load as configured: one line
                first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
                raise LayoutError(f"{where}: the draft does not load as its {CONFIG} describes it ({type(e).__name__}: "
                                  f"{first[:200]}); check its sizes (vocab_size, draft_vocab_size, hidden_size) "
                                  "against model.safetensors") from None
    if sample_from_anchor is not None:
        value, source = sample_from_anchor, "forced (--sample-from-anchor)"
    elif said.known:
        value, source = said.sample_from_anchor, said.source
    else:
        value, source = acceptance["true"] >= acceptance["false"], "measured"
    out = candidate(value)
    report = {"layout": layout, "anchor": {"value": value, "source": source}}
    if acceptance is not None:
        report["anchor"]["acceptance"] = acceptance
    if not from_kit:  # a released draft: every key it carries, and how the kit read it
        out[RECORD] = {**report, "config": cfg}
    write_draft(dest, out, src)
    return out, {**report, "notes": notes}


def export_draft(src: Path, dest: Path, layout: str = "native") -> dict:
    """A speculators DSpark checkpoint -> the native or SGLang layout in `dest`; returns the written config."""
    src, dest = Path(src), Path(dest)
    if layout not in EXPORTS:
        raise LayoutError(f"export --layout {layout}: one of {', '.join(EXPORTS)}")
    cfg = _read(src)
    if layout_of(cfg) != "speculators":
        raise LayoutError(f"export {src}: speculators_model_type is {cfg.get('speculators_model_type')!r}, "
                          "expected 'dspark' (a checkpoint the kit trained or imported)")
    out = (to_sglang if layout == "sglang" else to_native)(cfg, where=f"export {src}")
    write_draft(dest, out, src)
    return out
