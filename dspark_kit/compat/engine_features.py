"""What an engine release does with a DSpark draft, read from its source tree.

The detectors take the folder that holds `vllm/` or `vllm_ascend/` (an
installed site-packages, or a release's source package unpacked by
`engine_sources`) and read files as text or through `ast`: nothing is imported,
so they run where neither engine can (a laptop, CI). `make compat` runs them
over every listed release and writes the table the gates read
(`engine_table.json`, rendered to docs/COMPAT.md); planning runs the same
detectors over an installed engine, so the table and the install agree by
construction.

Features (the table's columns):
- dspark: the release serves speculative method "dspark" (a Qwen3 DSpark model
  in vLLM; in vllm-ascend also its proposer, on a paired vLLM that has it).
- anchor: how the speculators-config loader treats `sample_from_anchor`:
  "forced-bonus" (every checkpoint is rewritten to the bonus-anchor layout, the
  key is ignored), "default-false" (the key is read; missing means False),
  "default-true", or "none" (no loader).
- k_guard: the speculative config refuses K < block for DSpark, and on which
  config key (only configs carrying that key are refused).
- window: vllm-ascend applies `draft_window_size` to DSpark drafts (PR 14596).
- adaptive: vLLM's `enable_adaptive_verification`, vllm-ascend's
  `dynamic_spec_config` with method "dspark".
- config_keys: the speculators config keys the DSpark loader reads.
- spec_keys: the keys `--speculative-config` accepts (SpeculativeConfig's init
  fields; vLLM's config dataclasses forbid others, so a key outside them fails
  at start-up).
- draft_topk: `dspark_draft_topk` (sampled drafting from the draft's top k) is a
  speculative-config key DSpark takes (vllm-ascend: and its own proposer reads it).
- weight_checks: the DSpark model's load_weights refuses a reduced-vocabulary
  draft without lm_head/d2t and an expanded-vocabulary one without embed_tokens,
  and turns the confidence head off without its weights (0.34.0 dropped these;
  the kit's checkpoint findings make them on every release).
"""

from __future__ import annotations

import ast
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

# files the detectors read, relative to the folder holding the package
VLLM_FILES = {
    "model": "vllm/model_executor/models/qwen3_dspark.py",
    "speculative": "vllm/config/speculative.py",
    "loader": "vllm/transformers_utils/configs/speculators/algos.py",
    "dspark_config": "vllm/v1/worker/gpu/spec_decode/dspark/config.py",  # 0.34.0 on
}
ASCEND_FILES = {
    "dispatch": "vllm_ascend/spec_decode/__init__.py",
    "proposer": "vllm_ascend/spec_decode/dspark_proposer.py",
    "base_proposer": "vllm_ascend/spec_decode/llm_base_proposer.py",
    "loader_patch": "vllm_ascend/patch/platform/patch_speculative_config.py",
    "ascend_config": "vllm_ascend/ascend_config.py",
    "paired_vllm": ".github/vllm-release-tag.commit",  # in the source package only
}
ANCHOR_KINDS = ("forced-bonus", "default-false", "default-true", "none")


@dataclass(frozen=True)
class Features:
    engine: str  # vllm | vllm-ascend
    version: str
    dspark: bool
    anchor: str  # one of ANCHOR_KINDS
    k_guard: str | None  # config key the K >= block guard reads, None: no guard
    window: bool  # runtime draft_window_size for DSpark (vllm-ascend only)
    adaptive: bool
    config_keys: tuple[str, ...] = ()
    paired_vllm: str | None = None  # vllm-ascend: the vLLM release it was built against
    notes: tuple[str, ...] = field(default=())
    spec_keys: tuple[str, ...] = ()
    draft_topk: bool = False
    weight_checks: bool = False

    def as_row(self) -> dict:
        row = asdict(self)
        for key in ("config_keys", "notes", "spec_keys"):
            row[key] = list(getattr(self, key))
        return row

    @classmethod
    def from_row(cls, row: dict) -> Features:
        return cls(**{**row, **{key: tuple(row.get(key, ())) for key in ("config_keys", "notes", "spec_keys")}})


def _read(root: Path, rel: str) -> str | None:
    p = root / rel
    return p.read_text(errors="replace") if p.is_file() else None


# ---- the speculators-config loader (vLLM's algos.py) ------------------------


def _function(tree: ast.AST, name: str) -> ast.FunctionDef | None:
    return next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def loader_anchor(fn: ast.FunctionDef, config_name: str = "config_dict",
                  out_name: str = "pre_trained_config") -> str:
    """How one DSpark loader function treats sample_from_anchor (see module doc)."""
    forced = False
    default: bool | None = None
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if (isinstance(t, ast.Subscript) and _is_name(t.value, out_name)
                        and _const_str(t.slice) == "dspark_bonus_anchor"
                        and isinstance(node.value, ast.Constant) and node.value.value is True):
                    forced = True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and _is_name(node.func.value, config_name) and node.args
                and _const_str(node.args[0]) == "sample_from_anchor"):
            d = node.args[1] if len(node.args) > 1 else None
            default = bool(d.value) if isinstance(d, ast.Constant) else False
    if default is not None:
        return "default-true" if default else "default-false"
    return "forced-bonus" if forced else "none"


def loader_keys(fn: ast.FunctionDef, config_name: str = "config_dict") -> tuple[str, ...]:
    """Keys the loader reads from the checkpoint's config: config_dict["k"], config_dict.get("k"),
    and the string tuples it loops over to copy keys across."""
    keys: list[str] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Subscript) and _is_name(node.value, config_name):
            keys.append(_const_str(node.slice) or "")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and _is_name(node.func.value, config_name) and node.args):
            keys.append(_const_str(node.args[0]) or "")
        elif isinstance(node, ast.For) and isinstance(node.iter, (ast.Tuple, ast.List)):
            keys += [s for e in node.iter.elts if (s := _const_str(e))]
    return tuple(sorted({k for k in keys if k}))


def _dspark_loader(text: str | None, name: str = "update_dspark") -> ast.FunctionDef | None:
    if text is None:
        return None
    try:
        return _function(ast.parse(text), name)
    except SyntaxError:
        return None


# ---- vLLM -------------------------------------------------------------------

_K_GUARD = re.compile(r"self\.num_speculative_tokens\s*<\s*(\w+)\s*\)?:?\s*raise ValueError\(\s*\"DSpark requires num_speculative_tokens >= ")
_ADAPTIVE_FIELD = re.compile(r"^\s+enable_adaptive_verification\s*:\s*bool\b", re.MULTILINE)


def k_guard_key(speculative_src: str) -> str | None:
    """The config key of vLLM's 'DSpark requires num_speculative_tokens >= <key>' guard, if any."""
    m = _K_GUARD.search(speculative_src)
    return m.group(1) if m else None


def speculative_config_keys(speculative_src: str) -> tuple[str, ...]:
    """The keys `--speculative-config` takes: SpeculativeConfig's fields, less `field(init=False)`
    ones (vLLM's @config dataclasses forbid any other key)."""
    try:
        tree = ast.parse(speculative_src)
    except SyntaxError:
        return ()
    cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig"), None)
    if cls is None:
        return ()
    keys = []
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        v = stmt.value
        if isinstance(v, ast.Call) and any(kw.arg == "init" and isinstance(kw.value, ast.Constant)
                                           and kw.value.value is False for kw in v.keywords):
            continue
        keys.append(stmt.target.id)
    return tuple(sorted(keys))


_SUPPORTED_OPTIONS = re.compile(r"supported_options\s*=\s*frozenset\(\s*\{([^}]*)\}")
_WEIGHT_CHECKS = (
    re.compile(r"reduced_vocab\w*\s+and\s+not\s+includes_lm_head"),
    re.compile(r"reduced_vocab\w*\s+and\s+not\s+includes_draft_id_mapping"),
    re.compile(r"expanded\w*\s+and\s+not\s+includes_embed_tokens"),
    re.compile(r"not\s+includes_confidence_head"),
)


def dspark_takes_topk(spec_keys: tuple[str, ...], dspark_config_src: str | None) -> bool:
    """`dspark_draft_topk` is a speculative-config key, and where DSpark lists the method options
    it takes (0.34.0's DSparkSpeculatorConfig.supported_options), it is among them."""
    if "dspark_draft_topk" not in spec_keys:
        return False
    m = _SUPPORTED_OPTIONS.search(dspark_config_src or "")
    return m is None or "dspark_draft_topk" in m.group(1)


def vllm_features(root: Path, version: str) -> Features:
    spec = _read(root, VLLM_FILES["speculative"]) or ""
    model = _read(root, VLLM_FILES["model"])
    dspark_config = _read(root, VLLM_FILES["dspark_config"])
    loader = _dspark_loader(_read(root, VLLM_FILES["loader"]))
    dspark = model is not None and '"dspark"' in spec
    notes: list[str] = []
    guard = k_guard_key(spec) if dspark else None
    keys = loader_keys(loader) if loader else ()
    if guard and guard not in keys:
        notes.append(f"the K >= block guard reads {guard}, which a speculators config does not carry: "
                     "not applied to speculators checkpoints")
    spec_keys = speculative_config_keys(spec)
    if dspark and dspark_config and "def resolve_num_speculative_tokens" in dspark_config:
        notes.append("num_speculative_tokens defaults to the draft's block_size (the kit writes it explicitly)")
    weight_checks = dspark and all(p.search(model or "") for p in _WEIGHT_CHECKS)
    return Features(
        engine="vllm", version=version, dspark=dspark,
        anchor=loader_anchor(loader) if loader and dspark else "none",
        k_guard=guard, window=False,
        adaptive=dspark and bool(_ADAPTIVE_FIELD.search(spec)),
        config_keys=keys, notes=tuple(notes), spec_keys=spec_keys,
        draft_topk=dspark and dspark_takes_topk(spec_keys, dspark_config),
        weight_checks=weight_checks)


# ---- vllm-ascend ------------------------------------------------------------

_ASCEND_DISPATCH = re.compile(r"method\s*==\s*[\"']dspark[\"']")
_PROPOSER_KEY = re.compile(r"getattr\([^)]*hf_config,\s*[\"'](sample_from_anchor|dspark_bonus_anchor)[\"']")
_DYNAMIC_METHODS = re.compile(r"SUPPORTED_METHODS[^=]*=\s*\(([^)]*)\)")
_DSPARK_WINDOW_MARKERS = (
    re.compile(r"future_offset\s*=.*[\"']dspark[\"']"),
    re.compile(r"draft_window_size.*[\"']dspark[\"']"),
)


def window_support_from_source(text: str) -> bool:
    """The proposer applies draft_window_size to DSpark drafts (PR 14596: future_offset 0 for
    "dspark", not only "dflash"; before it the window was applied where DSpark's per-group block
    table later overwrote it)."""
    if "draft_window_size" not in text:
        return False
    return any(p.search(line) for p in _DSPARK_WINDOW_MARKERS for line in text.splitlines())


def paired_vllm_version(root: Path) -> str | None:
    tag = _read(root, ASCEND_FILES["paired_vllm"])
    return tag.strip().lstrip("v") if tag and tag.strip() else None


def ascend_features(root: Path, version: str, paired: Features | None,
                    paired_version: str | None = None) -> Features:
    """`paired`: the features of the vLLM this release runs on (its tag in the source package, or
    the vLLM installed beside it); DSpark serving and the loader come from there unless the
    release patches them."""
    dispatch = _read(root, ASCEND_FILES["dispatch"]) or ""
    proposer = _read(root, ASCEND_FILES["proposer"]) or ""
    base = _read(root, ASCEND_FILES["base_proposer"]) or ""
    cfg = _read(root, ASCEND_FILES["ascend_config"]) or ""
    own = bool(_ASCEND_DISPATCH.search(dispatch))
    notes: list[str] = []
    dspark = own and paired is not None and paired.dspark
    if own and paired is not None and not paired.dspark:
        notes.append(f"has DSpark code, but its vLLM {paired.version} has no method dspark")
    anchor = paired.anchor if paired is not None else "none"
    # vllm-ascend may wrap vLLM's loader (0.26.0rc1 backports vLLM PR 48639 this way)
    patched = _dspark_loader(_read(root, ASCEND_FILES["loader_patch"]), "_update_dspark")
    if patched is not None and loader_anchor(patched) != "none":
        anchor = loader_anchor(patched)
        notes.append(f"patches vLLM's DSpark loader: sample_from_anchor {anchor}")
    m = _PROPOSER_KEY.search(proposer)
    if dspark and m and m.group(1) == "dspark_bonus_anchor" and anchor.startswith("default"):
        anchor = "forced-bonus"  # the proposer only honours the bonus flag the loader no longer sets
    methods = _DYNAMIC_METHODS.search(cfg[cfg.find("class DynamicSpecConfig"):]) if "class DynamicSpecConfig" in cfg else None
    adaptive = dspark and methods is not None and "dspark" in methods.group(1)
    keys = paired.config_keys if paired is not None else ()
    return Features(
        engine="vllm-ascend", version=version, dspark=dspark,
        anchor=anchor if dspark else "none", k_guard=None,
        window=dspark and window_support_from_source(base), adaptive=adaptive,
        config_keys=keys, paired_vllm=paired_version or (paired.version if paired else None),
        notes=tuple(notes), spec_keys=paired.spec_keys if paired is not None else (),
        # vllm-ascend drafts with its own proposer: the key must be read there too
        draft_topk=dspark and paired is not None and paired.draft_topk and "dspark_draft_topk" in proposer,
        weight_checks=dspark and paired is not None and paired.weight_checks)
