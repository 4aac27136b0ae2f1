"""No code runs unasked: a verifier folder whose config.json `auto_map` names Python files has them
run only with `init --trust-remote-code` / `verifier.trust_remote_code: true`, as transformers and vLLM
ask. Each test plants a code file that writes a marker when imported, and checks that nothing ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import load_recipe
from tests.test_init import QWEN3_0_6B, TOKENIZER_FIXTURE, laptop_memory, verifier_dir  # noqa: F401 (a fixture)

PLANTED = """\
import os
from pathlib import Path
Path(os.environ["DSPARK_MARKER"]).write_text(str(os.getpid()))
from transformers import PretrainedConfig


class EvilConfig(PretrainedConfig):
    model_type = "evil_lm"
"""


def _folder(tmp_path: Path, monkeypatch, model_type: str, plant: bool = True) -> tuple[Path, Path]:
    marker = tmp_path / "ran.txt"
    monkeypatch.setenv("DSPARK_MARKER", str(marker))
    config = {**QWEN3_0_6B, "model_type": model_type,
              "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                           "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}
    if model_type != "qwen3":
        config["architectures"] = ["EvilForCausalLM"]
    folder = verifier_dir(tmp_path / "evil", TOKENIZER_FIXTURE, config)
    if plant:
        (folder / "configuration_evil.py").write_text(PLANTED)
        (folder / "modeling_evil.py").write_text(PLANTED)
    return folder, marker


def _init(folder: Path, out: Path, *extra: str):
    return CliRunner().invoke(app, ["init", "--verifier", str(folder), "-o", str(out), "--target-device", "cpu",
                                    *extra])


def test_a_folder_that_needs_its_code_is_refused_in_one_line_and_nothing_runs(tmp_path, monkeypatch):
    folder, marker = _folder(tmp_path, monkeypatch, "evil_lm")
    r = _init(folder, tmp_path / "r.yaml")
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "configuration_evil.py" in lines[0] and "--trust-remote-code" in lines[0], lines[0]
    assert not marker.exists(), "init imported the folder's code without --trust-remote-code"
    assert not (tmp_path / "r.yaml").exists()


@pytest.mark.usefixtures("laptop_memory")
def test_a_known_model_type_with_an_auto_map_loads_natively_and_runs_nothing(tmp_path, monkeypatch):
    """transformers knows qwen3: the auto_map's code is not needed, so it is not run, and the recipe
    says trust_remote_code false (today's main ran it and wrote true)."""
    folder, marker = _folder(tmp_path, monkeypatch, "qwen3")
    monkeypatch.chdir(tmp_path)
    r = _init(folder, tmp_path / "r.yaml")
    assert r.exit_code == 0, r.output
    assert not marker.exists(), "init imported the folder's code without --trust-remote-code"
    text = (tmp_path / "r.yaml").read_text()
    assert yaml.safe_load(text)["verifier"]["trust_remote_code"] is False
    assert "not needed" in next(ln for ln in text.splitlines() if "trust_remote_code" in ln)


def test_a_missing_code_file_is_named_not_the_tokenizer(tmp_path, monkeypatch):
    folder, _ = _folder(tmp_path, monkeypatch, "evil_lm", plant=False)
    r = _init(folder, tmp_path / "r.yaml", "--trust-remote-code")
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "configuration_evil.py" in lines[0] and "not in the folder" in lines[0], lines[0]
    assert "tokenizer" not in lines[0], lines[0]


def test_preflight_refuses_a_recipe_whose_verifier_needs_code_it_may_not_run(tmp_path, monkeypatch):
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.preflight.checks import run_preflight

    folder, marker = _folder(tmp_path, monkeypatch, "evil_lm")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"verifier": {"path": str(folder)}, "train": {"device": "cpu"}}))
    found = [f for f in run_preflight(Resolved(load_recipe(recipe), planning=True), probes=False)
             if f.code == "verifier-code"]
    assert len(found) == 1 and found[0].level == "error", found
    assert "configuration_evil.py" in found[0].message and "verifier.trust_remote_code: true" in found[0].message
    assert not marker.exists()
    recipe.write_text(yaml.safe_dump({"verifier": {"path": str(folder), "trust_remote_code": True},
                                      "train": {"device": "cpu"}}))
    findings = run_preflight(Resolved(load_recipe(recipe), planning=True), probes=False)
    assert not [f for f in findings if f.code == "verifier-code"]


def test_the_code_files_are_read_from_both_auto_maps(tmp_path):
    from dspark_kit.specdec.verifier_facts import custom_code

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "auto_map": {
        "AutoConfig": "org/repo--configuration_x.XConfig"}}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "XTokenizer", "auto_map": {
        "AutoTokenizer": ["tokenization_x.XTokenizer", None]}}))
    code = custom_code(tmp_path)
    assert code.files == ("configuration_x.py", "tokenization_x.py")
    assert code.needed == ("tokenization_x.py",)  # qwen3 is transformers' own; XTokenizer is not
    assert code.missing == code.files
