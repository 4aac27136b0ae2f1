"""vLLM / vLLM-Ascend plans against the commands a reference Ascend run used (docs/ASCEND.md,
docs/CONCEPTS.md#the-hidden-state-server, docs/CONCEPTS.md#k-and-the-draft-window)."""

import json
import shlex
from pathlib import Path

import pytest
from plan_helpers import plan_vllm

from dspark_kit.engines import vllm as vllm_engine
from dspark_kit.engines.serve_inputs import ServeInputs
from dspark_kit.engines.vllm import PlanError
from dspark_kit.recipe import recipe_from_dict
from dspark_kit.resolved import Resolved

SEED_VERIFIER = "/mnt/cephfs/models/Qwen3-30B-A3B/Qwen/Qwen3-30B-A3B"
SEED_LAYERS = [1, 12, 23, 34, 45]
ASCEND_ENV = {"HCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo",
              "HCCL_NPU_SOCKET_PORT_RANGE": "18500-18749", "HCCL_OP_EXPANSION_MODE": "AIV"}
JSON_FLAGS = {"--speculative-config", "--kv-transfer-config", "--compilation-config", "--additional-config"}


def flags(argv: list[str]) -> tuple[str, dict]:
    """(model, {flag: value or True}) from `vllm serve MODEL ...` or `python -m ...api_server --model M`."""
    if argv[:2] == ["vllm", "serve"]:
        model, rest = argv[2], argv[3:]
    else:
        rest = argv[3:]
        model = rest[rest.index("--model") + 1]
    out: dict = {}
    i = 0
    while i < len(rest):
        key = rest[i]
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            value = rest[i + 1]
            out[key] = json.loads(value) if key in JSON_FLAGS else value
            i += 2
        else:
            out[key] = True
            i += 1
    out.pop("--model", None)
    return model, out


def assert_matches_seed(plan, seed_cmd: str, allowed_extra: set[str]):
    seed_model, seed = flags(shlex.split(seed_cmd))
    model, ours = flags(plan.argv)
    assert model == seed_model
    for key, value in seed.items():
        assert ours.get(key) == value, f"{key}: ours {ours.get(key)!r} != seed {value!r}"
    assert set(ours) - set(seed) <= allowed_extra, set(ours) - set(seed)


def seed_recipe(**serve):
    # device cuda: these are the accelerator plans (a recipe on auto/cpu with engine vllm on a
    # machine without GPU gets vLLM's CPU build instead: tests/test_vllm_cpu_plan.py)
    return recipe_from_dict({
        "train": {"device": "cuda"},
        "verifier": {"path": SEED_VERIFIER, "trust_remote_code": True},
        "data": {"seq_length": 8192},
        "draft": {"block_size": 8, "num_layers": 5},
        "hidden_states": {"target_layer_ids": SEED_LAYERS},
        "serve": {"engine": "vllm-ascend", "num_speculative_tokens": 7, **serve},  # the reference run's K
    })


def test_chat_service_matches_seed_6_1_0():
    r = recipe_from_dict({
        "verifier": {"path": SEED_VERIFIER, "served_name": "qwen3-30b-a3b", "trust_remote_code": True},
        "serve": {"tensor_parallel_size": 2, "max_model_len": 16384, "gpu_memory_utilization": 0.9,
                  "seed": 42, "devices": "6,7"}})
    plan = plan_vllm(r, "chat", engine="vllm-ascend", port=8005, installed_versions={})
    seed = (f"python -m vllm.entrypoints.openai.api_server --model {SEED_VERIFIER} "
            "--served-model-name qwen3-30b-a3b --tensor-parallel-size 2 --port 8005 --max-model-len 16384 "
            "--trust-remote-code --gpu-memory-utilization 0.9 --seed 42")
    assert_matches_seed(plan, seed, {"--host"})
    assert plan.env == {**ASCEND_ENV, "ASCEND_RT_VISIBLE_DEVICES": "6,7"}
    assert plan.port == 8005 and plan.notes == []


def test_hidden_state_server_matches_seed_6_1_2(tmp_path: Path):
    # the verifier's config comes from a local config.json (48 layers, qwen3_moe): no hub
    verifier = tmp_path / "Qwen3-30B-A3B"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 48}))
    r = seed_recipe(tensor_parallel_size=2, devices="0,1",
                    compilation_config={"cudagraph_capture_sizes": [2, 4, 8, 16], "cudagraph_mode": "PIECEWISE"})
    r.verifier.path = str(verifier)
    plan = plan_vllm(r, "hidden-states", engine="vllm-ascend", installed_versions={})
    # what speculators' launch_vllm.py builds from the reference run's invocation (--include-last-layer appends 48)
    seed = (f"vllm serve {verifier} --tensor-parallel-size 2 --trust-remote-code --port 9736 "
            """--compilation-config '{"cudagraph_capture_sizes":[2,4,8,16],"cudagraph_mode":"PIECEWISE"}' """
            "--seed 42 --no-enable-chunked-prefill "
            """--speculative-config '{"method":"extract_hidden_states","num_speculative_tokens":1,"""
            """"draft_model_config":{"hf_config":{"eagle_aux_hidden_state_layer_ids":[1,12,23,34,45,48]}}}' """
            """--kv-transfer-config '{"kv_connector":"ExampleHiddenStatesConnector","kv_role":"kv_producer","""
            """"kv_connector_extra_config":{"shared_storage_path":"/tmp/hidden_states"}}'""")
    assert_matches_seed(plan, seed, {"--host", "--served-model-name", "--gpu-memory-utilization"})
    # compact, deterministic JSON: byte-identical to the reference run's spelling
    assert '{"cudagraph_capture_sizes":[2,4,8,16],"cudagraph_mode":"PIECEWISE"}' in plan.argv
    assert plan.env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1" and "CUDA_VISIBLE_DEVICES" not in plan.env
    # the verifier's own layer count decides the exported last layer; a recipe that disagrees is refused
    from dspark_kit.recipe import RecipeError

    with pytest.raises(RecipeError, match="recipe says 50 but .* has 48"):
        plan_vllm(r, "hidden-states", engine="vllm-ascend", num_hidden_layers=50, installed_versions={})


def test_hidden_states_needs_a_layer_count():
    from dspark_kit.recipe import RecipeError

    r = seed_recipe()
    with pytest.raises(RecipeError, match="verifier.num_hidden_layers: no config.json"):
        plan_vllm(r, "hidden-states", engine="vllm", installed_versions={})
    r.verifier.num_hidden_layers = 48  # planning on a machine without the model
    argv = plan_vllm(r, "hidden-states", engine="vllm", installed_versions={}).argv
    assert '"eagle_aux_hidden_state_layer_ids":[1,12,23,34,45,48]' in argv[argv.index("--speculative-config") + 1]


def test_spec_serve_matches_seed_8_1(tmp_path: Path):
    ckpt = tmp_path / "checkpoints" / "1"
    ckpt.mkdir(parents=True)
    r = seed_recipe(tensor_parallel_size=2, gpu_memory_utilization=0.85, max_model_len=8192, enforce_eager=True,
                    draft_window_size="off", adaptive_verification="off")
    r.verifier.served_name = "qwen3-30b-a3b"
    plan = plan_vllm(r, "spec", engine="vllm-ascend", port=8014, checkpoint=ckpt,
                     installed_versions={"vllm-ascend": "0.27.1rc1"})
    seed = (f"vllm serve {SEED_VERIFIER} --port 8014 --served-model-name qwen3-30b-a3b "
            "--tensor-parallel-size 2 --gpu-memory-utilization 0.85 --max-model-len 8192 --enforce-eager "
            f"--trust-remote-code --speculative-config "
            f"""'{{"method":"dspark","model":"{ckpt.resolve()}","num_speculative_tokens":7}}'""")
    assert_matches_seed(plan, seed, {"--host", "--seed"})
    assert plan.notes == []  # nothing is wrong: K, window and the gate are decisions, not warnings
    assert "num_speculative_tokens 7: serve.num_speculative_tokens" in plan.decisions


def test_spec_serve_matches_seed_faq_q6(tmp_path: Path):
    save = tmp_path / "checkpoints"
    for e in (0, 1):
        (save / str(e)).mkdir(parents=True)
        (save / str(e) / "config.json").write_text(json.dumps({"block_size": 8, "sample_from_anchor": True}))
        (save / str(e) / "model.safetensors").write_bytes(b"")
    from dspark_kit.specdec.checkpoints import resolve_checkpoint

    latest = resolve_checkpoint(save, "latest")
    r = seed_recipe(tensor_parallel_size=2, max_model_len=40960, reasoning_parser="qwen3",
                    compilation_config={"cudagraph_capture_sizes": [7, 8], "cudagraph_mode": "PIECEWISE"},
                    draft_window_size="off", adaptive_verification="off")
    plan = plan_vllm(r, "spec", engine="vllm-ascend", port=8646, checkpoint=latest,
                     installed_versions={"vllm-ascend": "0.27.1rc1"})
    seed = (f"vllm serve {SEED_VERIFIER}/ --tensor-parallel-size 2 --port 8646 --max-model-len 40960 "
            "--trust-remote-code --reasoning-parser qwen3 "
            """--compilation-config '{"cudagraph_capture_sizes":[7, 8],"cudagraph_mode":"PIECEWISE"}' """
            f"""--speculative-config '{{"method":"dspark","model":"{save / '1'}","num_speculative_tokens":7}}'""")
    seed = seed.replace(f"{SEED_VERIFIER}/", SEED_VERIFIER, 1)
    assert_matches_seed(plan, seed, {"--host", "--seed", "--served-model-name", "--gpu-memory-utilization"})
    # 40960 > the 8192 training window, full-attention draft, no window: the long-context warning
    assert any("max_model_len 40960 > 2x training window 8192" in n for n in plan.notes)


def test_trust_remote_code_and_cuda_env():
    r = seed_recipe(devices="2,3")
    r.verifier.trust_remote_code = False
    plan = plan_vllm(r, "chat", engine="vllm", installed_versions={})
    assert "--trust-remote-code" not in plan.argv
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    r.serve.reasoning_parser = "qwen3"
    assert "--reasoning-parser" in plan_vllm(r, "chat", engine="vllm", installed_versions={}).argv
    assert "--reasoning-parser" not in plan_vllm(r, "hidden-states", engine="vllm", num_hidden_layers=48,
                                                 installed_versions={}).argv
    r.serve.extra_args = ["--max-num-seqs", "16"]
    assert plan_vllm(r, "chat", engine="vllm", installed_versions={}).argv[-2:] == ["--max-num-seqs", "16"]


@pytest.mark.parametrize("version", ["0.27.1", "0.28.0", "0.33.0", None])
def test_k_is_the_recipes_on_every_serving_vllm(tmp_path: Path, version):
    """No surveyed vLLM bounds K from below for a speculators checkpoint (docs/COMPAT.md: the
    0.26-0.27 guard reads dspark_block_size, which such a config never carries)."""
    plan = plan_vllm(seed_recipe(adaptive_verification="off"), "spec", engine="vllm", checkpoint=tmp_path,
                     installed_versions={"vllm": version})
    spec = flags(plan.argv)[1]["--speculative-config"]
    assert spec == {"method": "dspark", "model": str(tmp_path.resolve()), "num_speculative_tokens": 7}
    assert not any("num_speculative_tokens" in n for n in plan.notes)  # nothing wrong: no warning


@pytest.mark.parametrize("engine,version,why", [
    ("vllm", "0.23.1", "lacks speculative method dspark"),
    ("vllm", "0.24.0", "lacks speculative method dspark"),
    ("vllm", "0.26.0", "bonus-anchor"),  # the loader ignores sample_from_anchor
    ("vllm-ascend", "0.24.0rc1", "lacks speculative method dspark"),  # its vLLM 0.24.0 has none
    ("vllm-ascend", "0.25.1rc1", "bonus-anchor"),
])
def test_an_engine_that_cannot_serve_the_checkpoint_is_refused(tmp_path: Path, engine, version, why):
    with pytest.raises(PlanError, match=why) as e:
        plan_vllm(seed_recipe(), "spec", engine=engine, checkpoint=tmp_path, installed_versions={engine: version})
    assert ">=" in str(e.value) and "\n" not in str(e.value)  # names the release that serves it, one line


# ---- draft_window_size rules, case by case (Resolved.window) ----------------

def window(tmp_path, setting, engine="vllm-ascend", support="yes", vcfg=None, **recipe_over):
    verifier = tmp_path / "verifier"
    verifier.mkdir(exist_ok=True)
    (verifier / "config.json").write_text(json.dumps({"num_hidden_layers": 8, **(vcfg or {})}))
    data = {"verifier": {"path": str(verifier)}, "data": {"seq_length": 4096},
            "serve": {"draft_window_size": setting, "engine": engine}}
    for k, v in recipe_over.items():
        section, key = k.split("__")
        data.setdefault(section, {})[key] = v
    res = Resolved(recipe_from_dict(data), tmp_path / "run", planning=True, window_support=support,
                   installed={"vllm": "0.30.0", "vllm-ascend": "0.30.0rc2"})
    d = res.window
    return type("D", (), {"window": d.value, "notes": list(d.notes), "source": d.source})


def test_window_int_at_or_above_training_window(tmp_path):
    d = window(tmp_path, 4096)
    assert d.window == 4096 and d.notes == []


def test_window_below_training_window_warns(tmp_path):
    d = window(tmp_path, 1024)
    assert d.window == 1024 and any("1024 < training window 4096" in n for n in d.notes)


def test_window_auto_uses_tune_result_then_training_window(tmp_path):
    assert window(tmp_path, "auto").window == 4096
    sliding = window(tmp_path, "auto", draft__attention="sliding", draft__sliding_window=512)
    assert sliding.window == 512  # training window of a sliding-window draft
    (tmp_path / "run" / "eval").mkdir(parents=True)
    (tmp_path / "run" / "eval" / "window_tune.json").write_text(json.dumps({"recommended_window": 6144}))
    d = window(tmp_path, "auto")
    assert d.window == 6144 and "window_tune.json" in d.source


def test_window_off(tmp_path):
    assert window(tmp_path, "off").window is None
    assert window(tmp_path, False).window is None  # YAML reads a bare `off` as false


def test_window_deepseek_v4_native_draft_warns(tmp_path):
    d = window(tmp_path, 4096, vcfg={"model_type": "deepseek_v4"})
    assert d.window == 4096 and any("DeepSeek-V4" in n for n in d.notes)
    assert not any("DeepSeek-V4" in n for n in window(tmp_path, 4096, vcfg={"model_type": "qwen3_moe"}).notes)


def test_window_needs_the_dspark_apply_point(tmp_path):
    d = window(tmp_path, 4096, support="no")
    assert d.window is None and any("omitted" in n and ">= 0.27.1rc1" in n for n in d.notes)
    d = window(tmp_path, 4096, support="unknown")  # unconfirmed: left out, and the note says how to opt in
    assert d.window is None and any("serve.assume_window_support" in n for n in d.notes)
    d = window(tmp_path, 4096, support="unknown", serve__assume_window_support=True)
    assert d.window == 4096 and "serve.assume_window_support: true" in d.source


def test_window_support_comes_from_the_table_for_the_installed_version(tmp_path):
    def at(version):
        data = {"data": {"seq_length": 4096}, "verifier": {"num_hidden_layers": 8},
                "serve": {"draft_window_size": 4096, "engine": "vllm-ascend"}}
        return Resolved(recipe_from_dict(data), tmp_path / "run", planning=True,
                        installed={"vllm-ascend": version}).window
    assert at("0.26.0rc1").value is None  # serves DSpark, no window for it (docs/COMPAT.md)
    assert at("0.27.1rc1").value == 4096 and at("0.30.0rc2").value == 4096


def test_window_at_or_above_max_model_len_is_never_sent(tmp_path):
    d = window(tmp_path, 4096, serve__max_model_len=4096)
    assert d.window is None and "could never apply" in d.source
    assert window(tmp_path, 4096, serve__max_model_len=4097).window == 4096


def test_cuda_never_gets_a_window(tmp_path):
    d = window(tmp_path, 2048, engine="vllm")
    assert d.window is None
    assert sum("ignored" in n for n in d.notes) == 1
    assert window(tmp_path, "auto", engine="vllm").notes == []


def test_long_context_warning_only_without_sliding_layers(tmp_path):
    d = window(tmp_path, "auto", engine="vllm", serve__max_model_len=32768)
    assert any("32768 > 2x training window 4096" in n for n in d.notes)
    d = window(tmp_path, "auto", engine="vllm", serve__max_model_len=32768,
               draft__attention="sliding", draft__sliding_window=1024)
    assert not any("max_model_len" in n for n in d.notes)
    assert window(tmp_path, "auto", engine="vllm", serve__max_model_len=8192).notes == []


def test_plan_carries_the_window_only_on_ascend(tmp_path: Path):
    r = seed_recipe(draft_window_size=4096, adaptive_verification="off")
    plan = plan_vllm(r, "spec", engine="vllm-ascend", checkpoint=tmp_path, window_support="yes",
                     installed_versions={"vllm-ascend": "0.27.1rc1"})
    i = plan.argv.index("--additional-config")
    assert plan.argv[i + 1] == '{"draft_window_size":4096}'
    cuda = plan_vllm(r, "spec", engine="vllm", checkpoint=tmp_path, installed_versions={"vllm": "0.27.1"})
    assert "--additional-config" not in cuda.argv
    no_apply = plan_vllm(r, "spec", engine="vllm-ascend", checkpoint=tmp_path, window_support="no",
                         installed_versions={"vllm-ascend": "0.27.1rc1"})
    assert "--additional-config" not in no_apply.argv


def _with_head(tmp_path: Path, head: bool = True) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps({"enable_confidence_head": head, "sample_from_anchor": True}))
    return ckpt


@pytest.mark.parametrize("setting,version,eager,head,expected", [
    ("auto", "0.28.0", False, True, True),
    ("auto", "0.27.1", False, True, False),  # no adaptive verification before 0.28 (docs/COMPAT.md)
    ("auto", "0.30.0", True, True, False),  # needs CUDA graphs
    ("auto", "0.30.0", False, False, False),  # needs the confidence head
    ("auto", None, False, True, False),  # not installed here: auto stays off
    ("on", None, False, True, True),  # the user says the serving host has it
    ("off", "0.30.0", False, True, False),
])
def test_adaptive_verification_decision(tmp_path: Path, setting, version, eager, head, expected):
    r = seed_recipe()
    r.serve.adaptive_verification, r.serve.enforce_eager = setting, eager
    plan = plan_vllm(r, "spec", engine="vllm", checkpoint=_with_head(tmp_path, head),
                     installed_versions={"vllm": version})
    spec = flags(plan.argv)[1]["--speculative-config"]
    assert spec.get("enable_adaptive_verification", False) is expected
    assert any(d.startswith(f"adaptive verification {'on' if expected else 'off'}") for d in plan.decisions)


@pytest.mark.parametrize("version,eager,head,why", [
    ("0.30.0", True, True, "serve.enforce_eager"),
    ("0.30.0", False, False, "no confidence head"),
    ("0.27.1", False, True, ">= 0.28.0"),
])
def test_adaptive_verification_on_that_cannot_work_is_one_line(tmp_path: Path, version, eager, head, why):
    from dspark_kit.resolved import ResolveError

    r = seed_recipe()
    r.serve.adaptive_verification, r.serve.enforce_eager = "on", eager
    with pytest.raises(ResolveError, match=why) as e:
        plan_vllm(r, "spec", engine="vllm", checkpoint=_with_head(tmp_path, head), installed_versions={"vllm": version})
    assert str(e.value).startswith("serve.adaptive_verification on:") and "\n" not in str(e.value)


def test_ascend_adaptive_verification_is_dynamic_spec_config(tmp_path: Path):
    r = seed_recipe(draft_window_size=4096)
    plan = plan_vllm(r, "spec", engine="vllm-ascend", checkpoint=_with_head(tmp_path),
                     installed_versions={"vllm-ascend": "0.27.1rc1"})
    extra = flags(plan.argv)[1]["--additional-config"]
    assert extra == {"dynamic_spec_config": {"method": "dspark"}, "draft_window_size": 4096}


def test_spec_plan_without_a_trained_checkpoint_says_so_and_valid_names():
    plan = plan_vllm(seed_recipe(), "spec", engine="vllm", installed_versions={})
    assert any("does not exist yet" in n for n in plan.decisions)
    from dspark_kit.resolved import ResolveError

    with pytest.raises(ResolveError, match="--engine"):
        plan_vllm(seed_recipe(), "chat", engine="sglang")
    with pytest.raises(PlanError, match="--engine"):
        vllm_engine.plan_vllm(ServeInputs(seed_recipe(), "local"), "chat", port=8000)


def test_k_is_noted_as_assumed_only_when_it_was():
    """Reproduced: the seed recipe's dry run printed "K assumed = draft.block_size" next to
    "num_speculative_tokens 7 (serve.num_speculative_tokens)"; K was set, nothing was assumed.
    K is a decision, never a warning."""
    explicit = plan_vllm(seed_recipe(), "spec", engine="vllm-ascend", installed_versions={})
    assert "num_speculative_tokens 7: serve.num_speculative_tokens" in explicit.decisions
    assert not any("num_speculative_tokens" in n for n in explicit.notes), explicit.notes
    assert not any("assumed" in n or "block_size" in n for n in explicit.decisions), explicit.decisions
    auto = plan_vllm(seed_recipe(num_speculative_tokens="auto"), "spec", engine="vllm-ascend",
                     installed_versions={}).decisions
    assert any(n.startswith("num_speculative_tokens 8: auto: draft.block_size 8") for n in auto), auto


def test_seed_recipe_dry_run_does_not_say_k_was_assumed(tmp_path):
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    seed = Path(__file__).resolve().parents[1] / "recipes" / "qwen3-30b-a3b-ultrachat-ascend.yaml"
    res = CliRunner().invoke(app, ["serve", "-r", str(seed), "--role", "spec", "--dry-run", "-w", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "num_speculative_tokens 7" in res.stderr and "assumed" not in res.stderr
    assert "warning:" not in res.stderr, res.stderr  # every setting in the seed recipe is valid
    assert "draft_window_size" not in res.stdout  # 8192 >= max_model_len 8192: never applies
    assert "could never apply" in res.stderr and "note: adaptive verification off" in res.stderr


def test_cuda_recipe_adaptive_verification_on_the_command_line(tmp_path):
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    cuda = Path(__file__).resolve().parents[1] / "recipes" / "qwen3-8b-cuda.yaml"
    base = ["serve", "-r", str(cuda), "--role", "spec", "--dry-run", "-w", str(tmp_path),
            "--set", "serve.adaptive_verification=on"]
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 0, res.output
    assert '"enable_adaptive_verification":true' in res.stdout
    eager = CliRunner().invoke(app, [*base, "--set", "serve.enforce_eager=true"])
    assert eager.exit_code != 0
    [line] = [ln for ln in eager.stderr.splitlines() if ln.strip()]
    assert "serve.adaptive_verification on" in line and "serve.enforce_eager" in line
