"""The resolver decides each derived value once; one test per rule, plus the three reproduced bugs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dspark_kit.recipe import recipe_from_dict
from dspark_kit.resolved import Resolved, ResolveError

SEED_LAYERS = [1, 12, 23, 34, 45]


def seed_like(tmp_path: Path, **serve) -> tuple:
    """A verifier dir with a 48-layer config (no weights needed for planning) and a seed-shaped recipe."""
    verifier = tmp_path / "Qwen3-30B-A3B"
    verifier.mkdir(exist_ok=True)
    (verifier / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 48}))
    recipe = recipe_from_dict({
        "workdir": str(tmp_path / "run"),
        "verifier": {"path": str(verifier)},
        "data": {"seq_length": 8192},
        "draft": {"block_size": 8, "num_layers": 5, "mask_token_id": 151669},
        "hidden_states": {"target_layer_ids": SEED_LAYERS},
        "serve": {"engine": "vllm-ascend", **serve},
    })
    return recipe, verifier


def write_ckpt(path: Path, verifier: str, block: int = 8, ids=SEED_LAYERS, slots: int | None = None) -> Path:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = {"speculators_model_type": "dspark", "block_size": block, "mask_token_id": 151669, "sample_from_anchor": True,
           "aux_hidden_state_layer_ids": list(ids),
           "speculators_config": {"verifier": {"name_or_path": verifier},
                                  "proposal_methods": [{"speculative_tokens": slots or block}]}}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({"w": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def write_tune(run: Path, **data) -> None:
    (run / "eval").mkdir(parents=True, exist_ok=True)
    (run / "eval" / "window_tune.json").write_text(json.dumps(data))


# ---- K ---------------------------------------------------------------------------


def test_k_auto_is_the_checkpoints_trained_slots(tmp_path):
    recipe, verifier = seed_like(tmp_path)
    assert Resolved(recipe, planning=True).k.value == 8  # nothing trained: draft.block_size
    write_ckpt(tmp_path / "run" / "checkpoints" / "checkpoint_best", str(verifier), block=8, slots=6)
    k = Resolved(recipe).k
    assert k.value == 6 and "trained slots" in k.source


def test_k_explicit_wins_and_tune_beats_the_checkpoint(tmp_path):
    recipe, verifier = seed_like(tmp_path, num_speculative_tokens=7)
    write_ckpt(tmp_path / "run" / "checkpoints" / "checkpoint_best", str(verifier))
    write_tune(tmp_path / "run", recommended_window=None, recommended_k=5)
    assert Resolved(recipe).k.value == 7  # the reference recipe's explicit choice is kept
    recipe.serve.num_speculative_tokens = "auto"
    k = Resolved(recipe).k
    assert k.value == 5 and "tuned" in k.source


def test_bench_records_the_k_the_server_got(tmp_path):
    """Bench records the K the server got, read back from its metrics, not the recipe's."""
    from dspark_kit.stages.server_plan import server_plan
    from dspark_kit.stages.serving.bench import served_k

    recipe, verifier = seed_like(tmp_path, engine="vllm", num_speculative_tokens=7)
    recipe.train.device = "cuda"  # planned for the GPU box (here it would be vLLM's CPU build: no spec)
    ckpt = write_ckpt(tmp_path / "run" / "checkpoints" / "checkpoint_best", str(verifier))
    res = Resolved(recipe, installed={"vllm": "0.30.0"})
    argv = server_plan(res, "spec").argv
    served = json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"]
    assert served == res.k.value == 7 and ckpt.exists()
    # bench reads K back from the server's per-position series (vLLM exports one per drafted slot)
    metrics = {"acceptance_length": 2.0, "per_position_acceptance": [0.5] * 6}
    assert served_k(metrics, res)["num_speculative_tokens"] == 6
    assert served_k(None, res)["num_speculative_tokens"] is None  # a chat server: no K at all


# ---- window ----------------------------------------------------------------------


@pytest.mark.slow
def test_null_tune_means_no_window_for_eval_and_every_engine(tmp_path, tiny_verifier):
    """Reproduced: with {"recommended_window": null} eval ran without a window while the Ascend command
    got 8192. Now eval, the local engine and vllm-ascend agree: no window."""
    from dspark_kit.stages.server_plan import server_plan

    recipe, verifier = seed_like(tmp_path)
    write_ckpt(tmp_path / "run" / "checkpoints" / "checkpoint_best", str(verifier))
    write_tune(tmp_path / "run", recommended_window=None)
    ascend = Resolved(recipe, window_support="yes", installed={"vllm-ascend": "0.27.1rc1"})
    assert ascend.window.value is None
    assert "--additional-config" not in server_plan(ascend, "spec").argv
    assert Resolved(recipe).window.value is None
    local = recipe.model_copy(deep=True)
    local.serve.engine = "local"
    assert "--draft-window-size" not in server_plan(Resolved(local), "spec").argv
    write_tune(tmp_path / "run", recommended_window=8192)
    assert Resolved(recipe, window_support="yes").window.value == Resolved(local).window.value == 8192
    argv = server_plan(Resolved(local), "spec").argv
    assert argv[argv.index("--draft-window-size") + 1] == "8192"


def test_a_tuned_window_below_training_says_it_was_measured(tmp_path):
    """The tiny rehearsal's tune picks 64 < training window 256 (measured best there): the warning
    says the tune chose it instead of claiming acceptance usually drops; a hand-set one keeps pitfall 9."""
    recipe, verifier = seed_like(tmp_path)
    write_ckpt(tmp_path / "run" / "checkpoints" / "checkpoint_best", str(verifier))
    train_w = recipe.training_window
    recipe.serve.extra_args = ["--block-size", "64"]  # vllm-ascend's default 128-token block is above the window
    write_tune(tmp_path / "run", recommended_window=64)
    tuned = Resolved(recipe, window_support="yes").window
    assert tuned.value == 64 < train_w
    assert any("the tune measured it best" in n for n in tuned.notes), tuned.notes
    recipe.serve.draft_window_size = 64
    manual = Resolved(recipe, window_support="yes").window
    assert any("usually drops" in n for n in manual.notes) and not any("tune" in n for n in manual.notes)


def test_a_window_below_the_engines_kv_block_is_refused(tmp_path):
    from dspark_kit.resolved import ResolveError

    recipe, _ = seed_like(tmp_path)
    recipe.serve.draft_window_size = 64
    with pytest.raises(ResolveError, match="< the KV block 128 .vllm-ascend's default"):
        _ = Resolved(recipe, window_support="yes").window
    recipe.serve.engine = "local"  # 16-token blocks: 64 is four of them
    assert Resolved(recipe).window.value == 64


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"recommended_window": -3}', '{"recommended_window": "x"}'])
def test_a_corrupt_tune_file_is_one_line_naming_it(tmp_path, text):
    recipe, _ = seed_like(tmp_path)
    (tmp_path / "run" / "eval").mkdir(parents=True)
    (tmp_path / "run" / "eval" / "window_tune.json").write_text(text)
    with pytest.raises(ResolveError, match="window_tune.json") as e:
        Resolved(recipe, planning=True).window  # noqa: B018 - the property decides
    assert "\n" not in str(e.value) and "dspark-kit tune" in str(e.value)


def test_window_off_in_yaml_plans_the_cuda_spec_command(tmp_path):
    """Reproduced: `draft_window_size: off` became False -> 0 -> "must be positive"."""
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    repo = Path(__file__).resolve().parents[1]
    res = CliRunner().invoke(app, ["serve", "-r", str(repo / "recipes" / "qwen3-8b-cuda.yaml"), "--role", "spec",
                                   "--engine", "vllm", "--dry-run", "-w", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert '"method":"dspark"' in res.output


# ---- verifier, checkpoint, env ---------------------------------------------------


def test_served_name_is_the_resolved_verifier_unless_named(tmp_path):
    recipe, verifier = seed_like(tmp_path)
    assert Resolved(recipe).served_name == str(verifier)
    recipe.verifier.served_name = "qwen3-30b-a3b"
    assert Resolved(recipe).served_name == "qwen3-30b-a3b"


def test_layer_count_from_config_else_the_recipe(tmp_path):
    from dspark_kit.recipe import RecipeError

    recipe, _ = seed_like(tmp_path)
    assert Resolved(recipe).num_hidden_layers == 48
    recipe.verifier.path = str(tmp_path / "absent")
    with pytest.raises(RecipeError, match="verifier.num_hidden_layers"):
        Resolved(recipe).num_hidden_layers  # noqa: B018
    recipe.verifier.num_hidden_layers = 48
    assert Resolved(recipe).exported_layer_ids == [*SEED_LAYERS, 48]


def test_preflight_and_serve_judge_a_checkpoint_alike(tmp_path):
    """Reproduced: layer ids [1,12,23,34,46] only warned in preflight (no verifier config here) but
    failed serve. Both now use Resolved.checkpoint_findings with verifier.num_hidden_layers."""
    from dspark_kit.stages.preflight.checks import run_preflight
    from dspark_kit.stages.server_plan import ServeError, checked_server

    recipe, _ = seed_like(tmp_path)
    recipe.verifier.path = "/mnt/cephfs/models/Qwen3-30B-A3B"  # not on this machine
    recipe.verifier.num_hidden_layers = 48
    write_ckpt(tmp_path / "run" / "checkpoints" / "checkpoint_best", recipe.verifier.path, ids=[1, 12, 23, 34, 46])
    findings = run_preflight(Resolved(recipe), probes=False)
    assert any(f.level == "error" and "[1, 12, 23, 34, 46]" in f.message for f in findings)
    with pytest.raises(ServeError, match=r"layer-ids: .*\[1, 12, 23, 34, 46\]"):
        checked_server(Resolved(recipe, tmp_path / "run", planning=True), "spec")


def test_the_users_hccl_env_survives_serving_and_training(tmp_path, monkeypatch):
    """Reproduced: a user's HCCL_SOCKET_IFNAME=eth0 became lo when serving but stayed eth0 in training."""
    from dspark_kit.stages.server_plan import server_plan
    from dspark_kit.stages.training.train import launch_plan

    monkeypatch.setenv("HCCL_SOCKET_IFNAME", "eth0")
    recipe, _ = seed_like(tmp_path, devices="0,1")
    serve = server_plan(Resolved(recipe, installed={}), "chat")
    train = launch_plan(recipe, [], "npu")
    assert serve.env["HCCL_SOCKET_IFNAME"] == train.env["HCCL_SOCKET_IFNAME"] == "eth0"
    assert serve.env["GLOO_SOCKET_IFNAME"] == "lo"  # defaults still fill what the user left unset
    assert {**os.environ, **serve.env}["HCCL_SOCKET_IFNAME"] == "eth0"  # what ManagedServer starts with


def test_no_second_derivation_in_the_package():
    """grep: the derived values are decided in resolved/ (and window/K helpers it calls) only."""
    pkg = Path(__file__).resolve().parents[1] / "dspark_kit"
    import re

    offenders = []
    patterns = [r"resolve_verifier_path\(", r"planned_verifier_path\(", r"(?<!kv_)block_size - 1",
                r"served_name or ", r"NPU_ENV_DEFAULTS",
                r'/ "(checkpoints|prepared|regen\.jsonl|eval|bench|logs|report|serve|hidden_states)"',
                r'"window_tune\.json"', r'"(manifest|state)\.json"',
                # devices and dtypes: Resolved.train_device / serve_device / eval_device / *_dtype
                r"\.train\.device\b", r'"float32" if', r"\.verifier\.dtype\b", r"\.hidden_states\.dtype\b"]
    allowed = {"rundir.py", "devices.py", "tiny_verifier.py", "gguf_verifier.py", "rendezvous.py"}
    # sweep_rules.candidate_ks lists the K values tune compares; it decides no served K
    for f in pkg.rglob("*.py"):
        text = f.read_text()
        for p in patterns:
            if f.name == "sweep_rules.py" and "block_size - 1" in p:
                continue
            if re.search(p, text) and f.name not in allowed and f.parent.name != "resolved":
                offenders.append(f"{f.relative_to(pkg)}: {p}")
    # detect_device: Resolved decides; below it only checks a device it was handed is here
    checks_only = {"devices.py", "specdec/verifier.py", "compat/train_entry.py", "compat/patches.py"}
    offenders += [str(f.relative_to(pkg)) for f in pkg.rglob("*.py") if "detect_device(" in f.read_text()
                  and str(f.relative_to(pkg)) not in checks_only and f.parent.name != "resolved"]
    assert not offenders, offenders


# ---- devices and dtypes ------------------------------------------------------------


def test_hidden_states_and_local_engine_agree_on_device_and_dtype(tmp_path, monkeypatch):
    """Reproduced: with train.device auto on CUDA, in-process hidden states came out of a bf16 forward
    while the local engine's extraction server ran float32 (`--device auto --dtype float32`). One
    rule now (float32 on CPU, verifier.dtype on accelerators), decided in Resolved."""
    import shlex

    import yaml
    from typer.testing import CliRunner

    from dspark_kit import devices
    from dspark_kit.cli import app
    from dspark_kit.stages.hidden import hidden_states

    monkeypatch.setattr(devices, "cuda_available", lambda: True)  # this machine "has" a GPU
    monkeypatch.setattr(devices, "npu_available", lambda: False)
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "workdir": str(tmp_path / "run"), "verifier": {"path": str(verifier), "dtype": "bfloat16"},
        "hidden_states": {"target_layer_ids": [1, 2, 3]}, "train": {"device": "auto"},
        "serve": {"engine": "local"}}))
    seen = {}

    class Summary:
        def as_dict(self):
            return {"generated": 0}

    def generate_offline(prepared, verifier_path, layer_ids, **kw):
        seen.update(kw)
        return Summary()

    monkeypatch.setattr(hidden_states, "generate_offline", generate_offline)
    ran = CliRunner().invoke(app, ["hidden-states", "-r", str(recipe)])
    assert ran.exit_code == 0, ran.output
    planned = CliRunner().invoke(app, ["serve", "-r", str(recipe), "--role", "hidden-states", "--dry-run"])
    assert planned.exit_code == 0, planned.output
    argv = shlex.split(planned.stdout.strip().splitlines()[-1])
    local = {flag: argv[argv.index(flag) + 1] for flag in ("--device", "--dtype", "--hidden-states-dtype")}
    assert (seen["device"], seen["dtype"]) == (local["--device"], local["--dtype"]) == ("cuda", "bfloat16")
    assert seen["out_dtype"] == local["--hidden-states-dtype"]
    res = Resolved(recipe_from_dict(yaml.safe_load(recipe.read_text())))
    summary = res.summary()
    assert summary["serve_dtype"]["value"] == summary["hidden_states_dtype"]["value"] == "bfloat16"
    assert "verifier.dtype on cuda" in summary["eval_dtype"]["source"]
    assert "detected cuda" in summary["train_device"]["source"]


def test_dtype_rule_is_float32_on_cpu(tmp_path):
    recipe, _ = seed_like(tmp_path, engine="local")
    recipe.train.device = "cpu"
    res = Resolved(recipe, planning=True)
    assert {res.hidden_states_dtype.value, res.serve_dtype.value, res.eval_dtype.value} == {"float32"}
    recipe.train.device = "npu"  # planned as written on this laptop
    res = Resolved(recipe, planning=True)
    assert res.train_device.value == res.serve_device.value == "npu" and res.eval_dtype.value == "bfloat16"
    ascend = Resolved(recipe, engine="vllm-ascend", planning=True)
    assert ascend.serve_device.value == "npu" and ascend.serve_dtype.value == "auto"  # vLLM's own default


# ---- planning builds nothing -----------------------------------------------------------


TINY = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml")


@pytest.mark.parametrize("command", [
    ["recipe", "show", "-r", TINY],
    ["serve", "-r", TINY, "--role", "spec", "--dry-run"],
    ["serve", "-r", TINY, "--role", "hidden-states", "--dry-run"],
    ["run", TINY, "--dry-run"],
    ["train", "-r", TINY, "--dry-run"],
    ["preflight", "-r", TINY],
], ids=lambda c: " ".join(w for w in c if w != TINY))
def test_planning_on_a_fresh_cache_builds_nothing(tmp_path, monkeypatch, command):
    """Reproduced: on a fresh cache `recipe show`, `serve --dry-run` and `run --dry-run` built the
    tiny verifier (~4 minutes). A plan names its cache path; the cache stays empty."""
    from typer.testing import CliRunner

    import dspark_kit.data.tiny_verifier as tiny
    from dspark_kit.cli import app

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("DSPARK_KIT_CACHE", str(cache))

    def no_build(*_a, **_k):
        raise AssertionError("planning started unpacking or building the tiny verifier")

    monkeypatch.setattr(tiny, "_unpack_or_build", no_build)  # unpacking or building it
    res = CliRunner().invoke(app, [*command, "--workdir", str(tmp_path / "run")])
    assert res.exit_code == 0, (res.output, res.exception)
    assert [p.name for p in cache.iterdir()] in ([], ["probes"])  # preflight remembers its fix probe
    if command[0] != "preflight":  # the plan names where the build will put it
        assert str(tiny.tiny_verifier_dir()) in res.output


@pytest.mark.slow  # starts the CLI as a user would (three processes)
def test_planning_commands_finish_on_a_fresh_cache(tmp_path):
    """The same end to end: with an empty DSPARK_KIT_CACHE each planning command returns well inside
    the ~4 minutes a tiny verifier build takes, and leaves the cache and the run folder empty."""
    import subprocess
    import sys

    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "DSPARK_KIT_CACHE": str(cache)}
    for command in (["recipe", "show", "-r", TINY], ["serve", "-r", TINY, "--role", "spec", "--dry-run"],
                    ["run", TINY, "--dry-run"]):
        proc = subprocess.run([sys.executable, "-m", "dspark_kit", *command, "-w", str(tmp_path / "run")], env=env,
                              capture_output=True, text=True, timeout=120, check=False)  # a build would hang here
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert list(cache.iterdir()) == [] and not (tmp_path / "run").exists()
