"""The served contract, by vLLM's own code (its CPU build): every checkpoint the tests train loads
through vLLM's speculators config loader, `create_engine_config` and `Qwen3DSparkModel.load_weights`
with every tensor consumed; three planted faults each fail with one line naming the key.

Faults are planted in copies: the session's trained run stays as trained (other modules read it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_RECIPE, set_args
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.specdec.checkpoints import resolve_checkpoint
from dspark_kit.stages.evaluation.decode_contract import contract_check

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow, pytest.mark.usefixtures("vllm_cpu_build")]
OTHER_BLOCK = 6  # the demo trains block 4


@pytest.fixture(scope="module")
def other_block_run(tmp_path_factory, tiny_verifier) -> Path:
    """A second trained draft with another block size (one short epoch: the contract, not acceptance)."""
    wd = tmp_path_factory.mktemp("block6-run")
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "--stages", "prepare,hidden-states,train",
           "--workdir", str(wd), *set_args(["data.limit=32", "train.max_anchors=8", "train.epochs=1",
                                            f"draft.block_size={OTHER_BLOCK}", "regen.enabled=false"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return wd


def resolved(workdir: Path, *sets: str) -> Resolved:
    return Resolved(load_recipe(TINY_RECIPE, [*sets]), workdir)


def test_every_trained_checkpoint_loads_whole_through_vllm(trained_run, other_block_run):
    cases = [(resolved(trained_run), 4), (resolved(other_block_run, f"draft.block_size={OTHER_BLOCK}"), OTHER_BLOCK)]
    for res, block in cases:
        report = contract_check(res)
        [c] = report["checkpoints"]
        assert c["findings"] == [], c["findings"]
        view = c["vllm_view"]
        cfg, loaded = view["config"], view["load_weights"]
        assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == block
        assert cfg["sample_from_anchor"] is True and cfg["dspark_bonus_anchor"] is False
        assert cfg["eagle_aux_hidden_state_layer_ids"] == res.recipe.target_layer_ids(res.num_hidden_layers)
        assert cfg["mask_token_id"] == json.loads((res.checkpoint / "config.json").read_text())["mask_token_id"]
        engine = view["engine_config"]  # and what else the probe reports (anchor layout, lookahead, layers)
        assert (engine["method"], engine["num_speculative_tokens"]) == ("dspark", res.k.value), engine
        from safetensors import safe_open

        with safe_open(str(res.checkpoint / "model.safetensors"), framework="pt") as f:
            assert loaded["checkpoint_tensors"] == sorted(f.keys())  # every tensor consumed
        assert loaded["missing"] == []
        # what vLLM leaves to the target: the shared embedding and lm_head, and its unused mask placeholder
        assert set(loaded["unloaded_shared"]) <= {"lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"}


def _copy(trained_run: Path, tmp_path: Path, name: str) -> Path:
    src = resolve_checkpoint(trained_run / "checkpoints", "checkpoint_best")
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(ckpt: Path, change) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    change(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_planted_faults_fail_with_one_named_line_each(trained_run, tmp_path):
    no_anchor = _copy(trained_run, tmp_path, "no-anchor")
    _edit_config(no_anchor, lambda c: c.pop("sample_from_anchor"))
    layers = _copy(trained_run, tmp_path, "layers")
    _edit_config(layers, lambda c: c.update(aux_hidden_state_layer_ids=[1, 2, 4]))
    renamed = _copy(trained_run, tmp_path, "renamed")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(renamed / "model.safetensors"))
    tensors["fc.weight_renamed"] = tensors.pop("fc.weight")
    save_file(tensors, str(renamed / "model.safetensors"), metadata={"format": "pt"})

    report = contract_check(resolved(trained_run), [no_anchor, layers, renamed])  # one vLLM process
    got = {Path(c["checkpoint"]).name: c["findings"] for c in report["checkpoints"]}
    expect = {"no-anchor": ("contract-anchor", "sample_from_anchor"),
              "layers": ("contract-layer-ids", "aux_hidden_state_layer_ids"),
              "renamed": ("contract-load-weights", "fc.weight_renamed")}
    for name, (code, key) in expect.items():
        [finding] = got[name]
        assert finding["code"] == code and key in finding["message"], finding
        assert "\n" not in finding["message"]


def test_cli_exit_codes(trained_run, tmp_path):
    ok = CliRunner().invoke(app, ["contract", "-r", str(TINY_RECIPE), "-w", str(trained_run)])
    assert ok.exit_code == 0, ok.output
    assert ": ok, " in ok.stdout and "tensors loaded" in ok.stdout
    bad = _copy(trained_run, tmp_path, "no-anchor")
    _edit_config(bad, lambda c: c.pop("sample_from_anchor"))
    res = CliRunner().invoke(app, ["contract", "-r", str(TINY_RECIPE), "-w", str(trained_run),
                                   "--checkpoint", str(bad), "--json"])
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    assert out["ok"] is False and out["checkpoints"][0]["findings"][0]["code"] == "contract-anchor"
