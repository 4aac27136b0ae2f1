"""A DSpark draft in its own layout (as released, e.g. deepseek-ai/dspark_qwen3_8b_block7) and in
speculators' (what the kit trains, evaluates and serves): `dspark-kit import` / `export`.

The two layouts, as vLLM 0.34.0 reads them (its released source):

- **native**: a Qwen3 config (model_type qwen3) with architectures `Qwen3DSparkModel` (or
  `DSparkDraftModel`, which vLLM's `hf_config_override` renames), the DSpark keys at the top
  level: `block_size` (else `dspark_block_size`), `target_layer_ids` (zero-based: the verifier
  layer whose output feeds the draft; `dflash_config.target_layer_ids`, then
  `dspark_target_layer_ids`, take precedence), `mask_token_id` (`dflash_config` first),
  `draft_vocab_size`, `markov_rank`, `markov_head_type`, `enable_confidence_head`,
  `confidence_head_with_markov`, `target_hidden_size`, and `sample_from_anchor`, which vLLM's
  DSpark runtime reads with **default true** (`dspark/speculator.py`).
- **speculators**: `speculators_model_type: dspark`, the Qwen3 part under
  `transformer_layer_config`, `aux_hidden_state_layer_ids` = target_layer_ids + 1 (vLLM's
  speculators loader maps them back as aux - 1), and `sample_from_anchor`, which that loader reads
  with **default false**: the kit always writes it (checkpoints: anchor-missing).

K semantics, both layouts: a block of B positions gives B draft tokens with sample_from_anchor
true (the anchor is the first prediction position; vLLM's num_lookahead_tokens = K) and B - 1 with
false (the anchor is the bonus token; num_lookahead_tokens = K + 1). Only the default of a missing
key differs between the layouts, so `slots` takes the layout.

Tensors: both layouts load through the same `Qwen3DSparkForCausalLM.load_weights` (which adds
the `model.` prefix itself), so model.safetensors is copied byte for byte (and speculators'
config.py beside it, when there is one). An export carries the
speculators-only keys under `dspark_kit_speculators` (vLLM ignores it), so export then import
gives back the same config.json.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from dspark_kit.specdec.checkpoints import CONFIG, WEIGHTS

NATIVE_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel")
SPECULATORS_ARCH = "DSparkSpeculator"
CARRY = "dspark_kit_speculators"
# DSpark keys that sit at the top level in both layouts
SHARED = ("draft_vocab_size", "target_hidden_size", "mask_token_id", "markov_rank", "markov_head_type",
          "enable_confidence_head", "confidence_head_with_markov", "block_size", "sample_from_anchor")
# keys of a native config that are DSpark's, not the Qwen3 layer config's
NATIVE_ONLY = ("architectures", "target_layer_ids", "dspark_target_layer_ids", "dspark_block_size",
               "dflash_config", CARRY)


class LayoutError(ValueError):
    """One line naming the draft, the key and the fix."""


def layout_of(cfg: dict) -> str | None:
    """"speculators", "native" or None (neither: not a DSpark draft the kit reads)."""
    if cfg.get("speculators_model_type") == "dspark":
        return "speculators"
    if set(cfg.get("architectures") or ()) & set(NATIVE_ARCHS):
        return "native"
    return None


def slots(cfg: dict, layout: str) -> int | None:
    """Draft tokens a block gives (see the module doc): B with sample_from_anchor, else B - 1; a
    missing key is true in the native layout and false in speculators' (as vLLM reads each)."""
    block = cfg.get("block_size", cfg.get("dspark_block_size"))
    if not isinstance(block, int):
        return None
    anchor = cfg.get("sample_from_anchor", layout == "native")
    return block if anchor else block - 1


def _nested(cfg: dict, key: str):
    inner = cfg.get("dflash_config")
    return inner.get(key) if isinstance(inner, dict) and key in inner else None


def _target_layer_ids(cfg: dict, where: str) -> list[int]:
    for value in (_nested(cfg, "target_layer_ids"), cfg.get("dspark_target_layer_ids"), cfg.get("target_layer_ids")):
        if value:
            if not all(isinstance(i, int) for i in value):
                raise LayoutError(f"{where}: target_layer_ids {value} are not layer numbers")
            return list(value)
    raise LayoutError(f"{where}: no target_layer_ids (nor dflash_config.target_layer_ids): the draft does not "
                      "say which verifier layers feed it")


def to_speculators(native: dict, verifier: str, verifier_architectures: list[str] | None = None,
                   where: str = "draft") -> dict:
    """The speculators config of a native DSpark draft (the kit's layout); sample_from_anchor written
    as the draft was trained (the native default, true, when the key is absent)."""
    carry = native.get(CARRY) if isinstance(native.get(CARRY), dict) else {}
    block = native.get("block_size", native.get("dspark_block_size"))
    if not isinstance(block, int) or block < 1:
        raise LayoutError(f"{where}: no block_size (nor dspark_block_size) in {CONFIG}")
    mask = _nested(native, "mask_token_id")
    mask = native.get("mask_token_id") if mask is None else mask
    if not isinstance(mask, int):
        raise LayoutError(f"{where}: no mask_token_id (nor dflash_config.mask_token_id) in {CONFIG}")
    layer = {k: v for k, v in native.items() if k not in NATIVE_ONLY and k not in SHARED}
    if "layer_architectures" in carry:
        layer["architectures"] = carry["layer_architectures"]
    derived = {k: native[k] for k in SHARED if k in native}
    derived |= {"transformer_layer_config": layer, "block_size": block, "mask_token_id": mask,
                "aux_hidden_state_layer_ids": [i + 1 for i in _target_layer_ids(native, where)],
                "sample_from_anchor": bool(native.get("sample_from_anchor", True))}
    if carry.get("speculators"):
        return {**derived, **carry["speculators"]}
    k = slots(derived, "speculators")
    return {"architectures": [SPECULATORS_ARCH], "speculators_model_type": "dspark",
            "speculators_config": {
                "algorithm": "dspark",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier,
                             "architectures": verifier_architectures or ["Qwen3ForCausalLM"]}},
            **derived}


def to_native(spec: dict, where: str = "checkpoint") -> dict:
    """The native layout of a speculators DSpark checkpoint, with what only speculators records
    carried under `dspark_kit_speculators` (vLLM ignores it; import restores it)."""
    layer = spec.get("transformer_layer_config")
    if not isinstance(layer, dict) or not layer:
        raise LayoutError(f"{where}: no transformer_layer_config in {CONFIG}; re-save it from the trainer")
    aux = spec.get("aux_hidden_state_layer_ids")
    if not aux:
        raise LayoutError(f"{where}: no aux_hidden_state_layer_ids in {CONFIG}; re-save it from the trainer")
    if "sample_from_anchor" not in spec:
        raise LayoutError(f"{where}: {CONFIG} has no sample_from_anchor, so its layout is unknown; add the value "
                          "it was trained with (speculators trains true)")
    native = {k: v for k, v in layer.items() if k != "architectures"}
    native["architectures"] = [NATIVE_ARCHS[0]]
    native |= {k: spec[k] for k in SHARED if k in spec}
    native["target_layer_ids"] = [i - 1 for i in aux]
    derived = {"transformer_layer_config", "aux_hidden_state_layer_ids", *SHARED}
    native[CARRY] = {"speculators": {k: v for k, v in spec.items() if k not in derived}}
    if "architectures" in layer:
        native[CARRY]["layer_architectures"] = layer["architectures"]
    return native


def _read(src: Path) -> dict:
    try:
        return json.loads((src / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LayoutError(f"{src}: cannot read {CONFIG} ({e})") from None


def _write(dest: Path, cfg: dict, src: Path) -> Path:
    """config.json + the weights byte for byte, into a temp folder renamed to `dest`."""
    if dest.exists():
        raise LayoutError(f"{dest} exists; pass a new folder")
    if not (src / WEIGHTS).is_file():
        shards = sorted(p.name for p in src.glob("*.safetensors"))
        why = f"sharded weights ({', '.join(shards[:3])}...)" if shards else f"no {WEIGHTS}"
        raise LayoutError(f"{src}: {why}; the kit reads a draft saved as one {WEIGHTS}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        # as transformers' save_pretrained writes a config (sorted keys, indent 2)
        (tmp / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        shutil.copyfile(src / WEIGHTS, tmp / WEIGHTS)
        if (src / "config.py").is_file():  # speculators' config class beside its config (auto_map)
            shutil.copyfile(src / "config.py", tmp / "config.py")
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def import_draft(src: Path, dest: Path, verifier: str, verifier_architectures: list[str] | None = None) -> dict:
    """A native DSpark draft -> the speculators layout in `dest`; returns the written config."""
    src, dest = Path(src), Path(dest)
    cfg = _read(src)
    kind = layout_of(cfg)
    if kind != "native":
        what = "already in the speculators layout (serve or train from it as is)" if kind else \
            f"not a DSpark draft (architectures {cfg.get('architectures')}, expected one of {', '.join(NATIVE_ARCHS)})"
        raise LayoutError(f"import {src}: {what}")
    out = to_speculators(cfg, verifier, verifier_architectures, where=f"import {src}")
    _write(dest, out, src)
    return out


def export_draft(src: Path, dest: Path) -> dict:
    """A speculators DSpark checkpoint -> the native layout in `dest`; returns the written config."""
    src, dest = Path(src), Path(dest)
    cfg = _read(src)
    if layout_of(cfg) != "speculators":
        raise LayoutError(f"export {src}: speculators_model_type is {cfg.get('speculators_model_type')!r}, "
                          "expected 'dspark' (a checkpoint the kit trained)")
    out = to_native(cfg, where=f"export {src}")
    _write(dest, out, src)
    return out
