"""Every command the kit generates goes through the REAL vLLM's own argument parser (its CPU
build, `make vllm-cpu`): all shipped recipes x roles as `vllm serve` (CUDA) and vllm-ascend
plans, the CPU build's plan, the served model names in order, and broken checkpoints. No
server starts here: one vLLM subprocess parses them all (tests/vllm_parse.py); the servers
are tests/test_vllm_real.py's. Skips/fails like it when .venv-vllm is missing.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from plan_helpers import plan_vllm
from test_vllm_real import RECIPES, REPO, TINY, vllm_recipe
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.engines.vllm import vllm_cpu_python
from dspark_kit.recipe import load_recipe

# vllm_cpu_build first: skip/fail before the trained run (minutes) is built
pytestmark = [pytest.mark.vllm_real, pytest.mark.slow, pytest.mark.usefixtures("vllm_cpu_build")]


def vllm_check(items: list[dict]) -> dict[str, dict]:
    """tests/vllm_parse.py in .venv-vllm's python: {id: {stage, error, speculative_config, model}}."""
    py = vllm_cpu_python()  # there: the vllm_cpu_build fixture checked it
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(py), str(REPO / "tests" / "vllm_parse.py")], input=json.dumps(items),
                          capture_output=True, text=True, timeout=600, env=env, cwd="/", check=False)
    assert proc.returncode == 0 and "@@RESULTS@@" in proc.stdout, proc.stderr[-3000:]
    results = json.loads(proc.stdout.rsplit("@@RESULTS@@", 1)[1])
    return {r["id"]: r for r in results}


def with_model(argv: list[str], model: str) -> list[str]:
    argv = list(argv)
    argv[2 if argv[:2] == ["vllm", "serve"] else argv.index("--model") + 1] = model
    return argv


def generated_commands(ckpt: Path, workdir: Path, tiny_verifier: Path) -> list[dict]:
    """All shipped recipes x roles, as `vllm serve` (CUDA) and vllm-ascend plans, plus the CPU plan.

    vLLM resolves the model while building engine args (a hub lookup when the path is not on
    disk), so commands whose verifier is not here are checked with the tiny verifier in the
    model slot: every flag is still the recipe's own."""
    items = []
    versions_of = {"vllm": {"vllm": "0.32.0"}, "vllm-ascend": {"vllm-ascend": "0.30.0rc2"}}
    for path in RECIPES:
        recipe = load_recipe(path)
        for engine in ("vllm", "vllm-ascend"):
            for role in ("chat", "hidden-states", "spec"):
                plan = plan_vllm(recipe, role, engine=engine, checkpoint=ckpt if role == "spec" else None,
                                 installed_versions=versions_of[engine], workdir=workdir,
                                 window_support="yes", cpu=False)
                assert plan.argv[:2] == ["vllm", "serve"], plan.argv
                here = Path(plan.argv[2]).is_dir()
                items.append({"id": f"{path.stem}/{engine}/{role}", "argv": plan.argv,
                              "check": plan.argv if here else with_model(plan.argv, str(tiny_verifier)),
                              "engine_config": path == TINY and engine == "vllm"})
    cpu_plan = plan_vllm(vllm_recipe(), "chat", engine="vllm", port=8000)
    items.append({"id": "tiny-cpu/vllm-cpu/chat", "argv": cpu_plan.argv, "engine_config": True})
    return items


def broken_checkpoints(ckpt: Path, root: Path) -> dict[str, Path]:
    wrong_type = root / "wrong-type"
    shutil.copytree(ckpt, wrong_type, symlinks=False)
    cfg = json.loads((wrong_type / "config.json").read_text())
    cfg["speculators_model_type"] = "eagle3-not-dspark"
    (wrong_type / "config.json").write_text(json.dumps(cfg))
    no_weights = root / "no-weights"
    shutil.copytree(ckpt, no_weights, symlinks=False)
    for f in no_weights.glob("*.safetensors*"):
        f.unlink()
    return {"wrong-type": wrong_type, "no-weights": no_weights}


MODEL_RUNNER_CHECK = "Model Runner V1 does not support: dspark speculative decoding"


@pytest.fixture(scope="session")
def parsed(trained_run, tiny_verifier, tmp_path_factory):
    """One vLLM subprocess (its import dominates) for every generated and broken-checkpoint command."""
    from dspark_kit.specdec.checkpoints import resolve_checkpoint

    ckpt = resolve_checkpoint(trained_run / "checkpoints", "checkpoint_best").resolve()
    items = generated_commands(ckpt, trained_run, tiny_verifier)
    broken = broken_checkpoints(ckpt, tmp_path_factory.mktemp("broken-ckpt"))
    tiny = load_recipe(TINY)
    for name, path in broken.items():
        plan = plan_vllm(tiny, "spec", engine="vllm", checkpoint=path, installed_versions={"vllm": "0.32.0"},
                         workdir=trained_run, cpu=False)
        items.append({"id": f"broken/{name}", "argv": plan.argv, "engine_config": True})
    results = vllm_check([{"id": i["id"], "argv": i.get("check", i["argv"]),
                           "engine_config": i["engine_config"]} for i in items])
    print("\n" + "\n".join(f"[vllm-real] {i}: {r['stage']} {r['error'] or ''}"[:300] for i, r in results.items()))
    return {"ckpt": ckpt, "items": items, "results": results, "broken": broken}


def test_generated_commands_parse_in_vllm(parsed):
    """vLLM's own parser accepts every flag the kit generates (a renamed or removed flag fails
    here); the real checkpoint's dspark config passes create_engine_config up to the CPU
    model-runner check (on a GPU the same config would load)."""
    ckpt, results = parsed["ckpt"], parsed["results"]
    for item in parsed["items"]:
        if item["id"].startswith("broken/"):
            continue
        r = results[item["id"]]
        if item["id"] == "tiny-cpu/vllm/spec":
            assert r["stage"] == "engine_config" and MODEL_RUNNER_CHECK in r["error"], r
        else:
            assert r["stage"] == "ok", f"{item['id']}: vLLM rejects `{shlex.join(item['argv'])}`: {r['error']}"
        if item["id"].endswith("/spec"):
            spec = r["speculative_config"]
            assert spec["method"] == "dspark" and spec["model"] == str(ckpt), spec


def test_served_model_names_parse_in_vllm_in_order(tiny_verifier):
    """A hidden-states server answers to the verifier path first, then verifier.served_name:
    vLLM's own parser keeps both, in order (its /v1/models lists them so, and speculators'
    trainer reads the first); the other roles carry served_name alone."""
    seed = load_recipe(REPO / "recipes" / "qwen3-30b-a3b-ultrachat-ascend.yaml")
    cpu = vllm_recipe("verifier.served_name=tiny")
    items, expected = [], {}
    for engine in ("vllm", "vllm-ascend"):
        for role in ("hidden-states", "chat"):
            plan = plan_vllm(seed, role, engine=engine, installed_versions={}, cpu=False)
            items.append({"id": f"seed/{engine}/{role}", "argv": with_model(plan.argv, str(tiny_verifier))})
            expected[items[-1]["id"]] = ([seed.verifier.path] if role == "hidden-states" else []) + ["qwen3-30b-a3b"]
    plan = plan_vllm(cpu, "hidden-states", engine="vllm", port=8000)
    items.append({"id": "tiny/vllm-cpu/hidden-states", "argv": plan.argv})
    expected["tiny/vllm-cpu/hidden-states"] = [str(tiny_verifier), "tiny"]
    results = vllm_check([i | {"engine_config": False} for i in items])
    for item in items:
        r = results[item["id"]]
        assert r["stage"] == "ok", f"{item['id']}: vLLM rejects `{shlex.join(item['argv'])}`: {r['error']}"
        assert r["served_model_name"] == expected[item["id"]], item["id"]


def test_broken_checkpoints_are_refused(parsed, trained_run):
    """A wrong model type and missing weights stop `dspark-kit serve --role spec` (the kit's
    checkpoint checks, before any command is printed); vLLM's config path refuses the wrong
    type itself but does not look at weights (it would fail only when loading them)."""
    for name, path in parsed["broken"].items():
        res = CliRunner().invoke(app, ["serve", "-r", str(TINY), "--role", "spec", "--engine", "vllm",
                                       "--set", "train.device=cuda", "-w", str(trained_run),
                                       "--checkpoint", str(path), "--dry-run"])
        assert res.exit_code == 2 and "vllm serve" not in res.stdout, (name, res.output)
    wrong = parsed["results"]["broken/wrong-type"]
    assert wrong["stage"] == "engine_config" and "SpeculativeConfig" in wrong["error"], wrong
    assert MODEL_RUNNER_CHECK not in wrong["error"]
    no_weights = parsed["results"]["broken/no-weights"]
    assert no_weights["stage"] == "engine_config" and MODEL_RUNNER_CHECK in no_weights["error"], no_weights
