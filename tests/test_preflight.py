"""preflight: each docs/PITFALLS.md pitfall planted in a copy of the tiny recipe or its artifacts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dspark_kit.recipe import dump_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.preflight.checks import has_errors, run_preflight

# every test reads the tiny verifier (its tokenizer and config); the shipped tiny recipe's
# test also because planning still builds the built-in verifier
pytestmark = pytest.mark.slow

HIDDEN, LAYERS = 128, 4  # the tiny verifier


def _write_checkpoint(root: Path, verifier: Path, mask_id: int, **overrides) -> Path:
    epoch = root / "checkpoints" / "0"
    epoch.mkdir(parents=True)
    config = {
        "speculators_model_type": "dspark", "block_size": 4, "sample_from_anchor": True,
        "mask_token_id": mask_id, "aux_hidden_state_layer_ids": [1, 2, 3],
        "transformer_layer_config": {"layer_types": ["full_attention"]},
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 4}],
                               "verifier": {"name_or_path": str(verifier)}},
    }  # fmt: skip
    config.update(overrides)
    (epoch / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": torch.zeros(2, 2)}, str(epoch / "model.safetensors"))
    os.symlink("0", root / "checkpoints" / "checkpoint_best")
    return epoch


def _write_regen(root: Path, reply: str = "the reply", **metadata) -> None:
    row = {"id": "regen-0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": reply}],
           "metadata": {"idx": 0, "finish_reasons": ["stop"], "endpoint": "http://127.0.0.1:9/v1", **metadata}}  # fmt: skip
    (root / "regen.jsonl").write_text(json.dumps(row) + "\n")


def _write_hidden_states(root: Path, layers: int = LAYERS) -> None:
    hs_dir = root / "prepared" / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    save_file({"hidden_states": torch.zeros(5, layers, HIDDEN, dtype=torch.bfloat16),
               "token_ids": torch.arange(5)}, str(hs_dir / "hs_0.safetensors"))  # fmt: skip
    (root / "prepared" / "prepare_meta.json").write_text(json.dumps({"thinking": False}))


@pytest.fixture()
def mask_id(tiny_verifier) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_verifier).convert_tokens_to_ids("<|MASK|>")


@pytest.fixture()
def recipe(tiny_recipe):
    tiny_recipe.serve.max_model_len = 512  # within 2x of the 256-token training window
    return tiny_recipe


@pytest.fixture()
def run(tmp_path, tiny_verifier, mask_id) -> Path:
    """A clean run dir: regen output, prepared meta, hidden states, one checkpoint."""
    _write_regen(tmp_path)
    _write_hidden_states(tmp_path)
    _write_checkpoint(tmp_path, tiny_verifier, mask_id)
    return tmp_path


def _pitfalls(findings, level=None) -> set[int]:
    return {f.pitfall for f in findings if level is None or f.level == level}


def _rewrite_config(run: Path, **changes) -> None:
    path = run / "checkpoints" / "0" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_clean_run_has_no_findings(recipe, run):
    assert run_preflight(Resolved(recipe, run), probes=False) == []


def test_shipped_tiny_recipe_has_no_errors_on_an_empty_workdir(tiny_recipe, tmp_path):
    findings = run_preflight(Resolved(tiny_recipe, tmp_path / "fresh"), probes=False)
    assert not has_errors(findings), findings


def test_pitfall_1_shifted_markov_prev_token(recipe, run, monkeypatch):
    from speculators.models.dspark.core import DSparkDraftModel
    from test_patches import _old_version

    shifted = _old_version(
        DSparkDraftModel.forward,
        "    prev_token_ids = block_tokens\n",
        "    prev_token_ids = torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1)\n",
    )
    assert 1 not in _pitfalls(run_preflight(Resolved(recipe, run)))
    monkeypatch.setattr(DSparkDraftModel, "forward", shifted)
    assert 1 in _pitfalls(run_preflight(Resolved(recipe, run)))


def test_pitfall_2_sliding_layers(recipe, run):
    recipe.draft.num_layers = 3
    recipe.draft.attention = "sliding"
    recipe.draft.full_attention_indices = [0]
    findings = run_preflight(Resolved(recipe, run), probes=False)
    assert any(f.pitfall == 2 and f.level == "warning" and "[1, 2]" in f.message for f in findings)
    # indices outside the draft never reach preflight: the recipe validator rejects them
    from dspark_kit.recipe import RecipeError, recipe_from_dict

    with pytest.raises(RecipeError, match="full_attention_indices"):
        recipe_from_dict({**recipe.model_dump(), "draft": {**recipe.draft.model_dump(), "full_attention_indices": [0, 3]}})


def test_pitfall_2_checkpoint_trained_with_sliding_layers(recipe, run):
    _rewrite_config(run, transformer_layer_config={"layer_types": ["sliding_attention"]})
    assert 2 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def test_pitfall_3_regen_by_another_model(recipe, run):
    _write_regen(run, model="qwen3-8b")
    assert 3 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def test_pitfall_3_checkpoint_trained_on_another_verifier(recipe, run):
    _rewrite_config(run, speculators_config={"proposal_methods": [{"speculative_tokens": 4}],
                                             "verifier": {"name_or_path": "/models/Qwen3-8B"}})  # fmt: skip
    assert 3 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def _not_prepared_yet(run: Path) -> None:
    """Rows nobody decided yet: preflight previews the rule prepare will apply (data/mode_rule.py)."""
    (run / "prepared" / "prepare_meta.json").unlink()


def test_pitfall_4_thinking_replies_with_thinking_off(recipe, run):
    _not_prepared_yet(run)
    _write_regen(run, reply="<think>\nfirst restate it\n</think>\n\nthe reply")
    assert 4 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def test_pitfall_4_reasoning_field_with_thinking_off(recipe, run):
    """regen stores a reasoning parser's output as reasoning_content: preflight reads it too."""
    _not_prepared_yet(run)
    row = {"conversations": [{"from": "human", "value": "hi"},
                             {"from": "gpt", "value": "the reply", "reasoning_content": "first restate it"}],
           "metadata": {"idx": 0, "finish_reasons": ["stop"]}}
    (run / "regen.jsonl").write_text(json.dumps(row) + "\n")
    assert 4 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def test_pitfall_4_thinking_on_without_any_reasoning(recipe, run):
    """Rows nobody decided yet: preflight says ahead what prepare will decide, by the same rule."""
    recipe.verifier.thinking = True
    _not_prepared_yet(run)
    _write_regen(run, thinking=True)
    found = [f for f in run_preflight(Resolved(recipe, run), probes=False) if f.pitfall == 4]
    assert [f.level for f in found] == ["error"] and "carries reasoning" in found[0].message
    assert found[0].message.startswith("prepare would fail on regen.jsonl: ")


def test_pitfall_4_recorded_decisions_are_not_judged_again(recipe, run):
    """Once prepare decided (prepare_meta.json), or regen did for a row (metadata.mode_check: this row
    is dropped), preflight never judges those rows again."""
    recipe.verifier.thinking = True
    (run / "prepared" / "prepare_meta.json").write_text(json.dumps({"thinking": True}))
    _write_regen(run, thinking=True)  # thinking rows with no reasoning: prepare's to judge, and it has
    assert [f for f in run_preflight(Resolved(recipe, run), probes=False) if f.pitfall == 4] == []
    recipe.verifier.thinking = False
    _not_prepared_yet(run)
    _write_regen(run, reply="<think>\na stray think\n</think>\n\nthe reply", thinking=False,
                 mode_check="reply carries reasoning but ...")
    assert [f for f in run_preflight(Resolved(recipe, run), probes=False) if f.pitfall == 4] == []


def test_pitfall_4_empty_think_block_is_not_thinking(recipe, run):
    _write_regen(run, reply="<think>\n\n</think>\n\nthe reply")
    assert 4 not in _pitfalls(run_preflight(Resolved(recipe, run), probes=False))


def test_pitfall_4_regen_recorded_another_mode(recipe, run):
    _write_regen(run, thinking=True)  # regen metadata records the mode it requested
    assert 4 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")
    _write_regen(run, thinking=False)
    assert 4 not in _pitfalls(run_preflight(Resolved(recipe, run), probes=False))


def test_pitfall_4_prepared_with_other_mode(recipe, run):
    (run / "prepared" / "prepare_meta.json").write_text(json.dumps({"thinking": True}))
    assert 4 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def test_pitfall_5_hidden_states_with_other_layer_count(recipe, run):
    _write_hidden_states(run, layers=LAYERS - 1)
    assert 5 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def test_pitfall_5_checkpoint_reads_other_layers(recipe, run):
    _rewrite_config(run, aux_hidden_state_layer_ids=[0, 1, 2])
    assert 5 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def test_pitfall_6_k_above_trained_slots(recipe, run):
    _rewrite_config(run, speculators_config={"proposal_methods": [{"speculative_tokens": 2}],
                                             "verifier": {"name_or_path": str(_verifier(run))}})  # fmt: skip
    recipe.serve.num_speculative_tokens = 3
    assert 6 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")
    recipe.serve.num_speculative_tokens = 5  # above block_size 4 (assignment skips the validator)
    assert 6 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def _verifier(run: Path) -> str:
    cfg = json.loads((run / "checkpoints" / "0" / "config.json").read_text())
    return cfg["speculators_config"]["verifier"]["name_or_path"]


def test_pitfall_7_mask_is_a_text_token_or_out_of_vocab(recipe, run, tiny_verifier):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    recipe.draft.mask_token_id = tok.convert_tokens_to_ids(tok.tokenize("hello")[0])
    assert 7 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")
    recipe.draft.mask_token_id = 10**6
    assert 7 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def test_pitfall_7_checkpoint_mask_differs_from_tokenizer(recipe, run, mask_id):
    _rewrite_config(run, mask_token_id=mask_id - 1)
    assert 7 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


@pytest.mark.parametrize("fault", ["missing", "truncated", "absent-epoch"])
def test_pitfall_8_wrong_or_incomplete_checkpoint(recipe, run, fault):
    weights = run / "checkpoints" / "0" / "model.safetensors"
    if fault == "missing":
        weights.unlink()
    elif fault == "truncated":
        weights.write_bytes(weights.read_bytes()[:40])
    else:
        recipe.serve.checkpoint = "7"
    assert 8 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "error")


def test_pitfall_9_window_below_training_window(recipe, run):
    recipe.serve.engine = "vllm-ascend"
    recipe.serve.assume_window_support = True  # vllm-ascend is not installed here to confirm the window
    recipe.serve.draft_window_size = 128  # below the training window, not below vllm-ascend's 128-token KV block
    assert 9 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "warning")
    recipe.serve.draft_window_size = 256
    assert 9 not in _pitfalls(run_preflight(Resolved(recipe, run), probes=False))


def test_pitfall_10_long_serving_context_without_window(recipe, run):
    recipe.serve.engine = "vllm"
    recipe.serve.max_model_len = 8192
    assert 10 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False), "warning")
    recipe.serve.engine = "vllm-ascend"  # draft_window_size auto -> a window is passed
    recipe.serve.assume_window_support = True
    assert 10 not in _pitfalls(run_preflight(Resolved(recipe, run), probes=False))
    recipe.serve.assume_window_support = False  # unconfirmed: left out, so the long context is a risk again
    assert 10 in _pitfalls(run_preflight(Resolved(recipe, run), probes=False))


def test_cli_exit_codes_and_json(recipe, run, tmp_path):
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    path = tmp_path / "r.yaml"
    path.write_text(dump_recipe(recipe))
    ok = CliRunner().invoke(app, ["preflight", "-r", str(path), "--workdir", str(run), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["ok"] is True
    (run / "checkpoints" / "0" / "model.safetensors").unlink()
    bad = CliRunner().invoke(app, ["preflight", "-r", str(path), "--workdir", str(run), "--json"])
    assert bad.exit_code == 1
    report = json.loads(bad.stdout)
    assert report["ok"] is False and any(f["pitfall"] == 8 for f in report["findings"])


def test_preflight_runs_before_train_and_stops_it(recipe, run, monkeypatch):
    """`train` refuses a planted pitfall before anything expensive starts."""
    import dspark_kit.stages.training.train as train_mod
    from dspark_kit.stages.preflight.checks import PreflightError
    from dspark_kit.stages.steps import run_stage

    (run / "prepared" / "prepare_meta.json").write_text(json.dumps({"thinking": True}))
    monkeypatch.setattr(train_mod, "run_training", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(PreflightError, match=r"pitfall 4"):
        run_stage("train", Resolved(recipe, run))


def test_hidden_size_is_checked_for_a_verifier_in_the_model_cache(tiny_recipe, tmp_path, monkeypatch):
    """Reproduced: preflight read config.json from a local directory only, so a verifier that lives in
    the HF cache (a hub id) lost the hidden-size check; it now asks Resolved.verifier_config."""
    from dspark_kit.specdec import verifier_facts

    monkeypatch.setattr(verifier_facts, "verifier_config", lambda path: (
        {"model_type": "qwen3", "num_hidden_layers": LAYERS, "hidden_size": 64} if path == "org/model" else None))
    tiny_recipe.verifier.path = "org/model"  # in the model cache, not a directory
    _write_hidden_states(tmp_path)  # [seq, 4 layers, 128]: written for another verifier
    found = [f for f in run_preflight(Resolved(tiny_recipe, tmp_path), probes=False) if f.pitfall == 5]
    assert found and found[0].level == "error" and "64" in found[0].message


def test_a_failed_verifier_build_surfaces_with_its_cause(tiny_recipe, tmp_path, monkeypatch):
    """Reproduced: any error while resolving the verifier (a bug in the tiny build) was swallowed as
    "verifier ... is not a local directory; mask token not checked" and the build tried again."""
    import dspark_kit.data.tiny_verifier as tiny

    monkeypatch.setenv("DSPARK_KIT_CACHE", str(tmp_path / "cache"))  # nothing built here yet

    calls = []

    def broken_build(*_a, **_k):
        calls.append(1)
        if len(calls) > 1:
            raise AssertionError("the failed build was swallowed and tried again")
        raise RuntimeError("a bug in the tiny verifier build")

    monkeypatch.setattr(tiny, "_unpack_or_build", broken_build)  # unpacking or building it
    with pytest.raises(RuntimeError, match="a bug in the tiny verifier build"):
        run_preflight(Resolved(tiny_recipe, tmp_path / "run"), probes=False)
    assert len(calls) == 1


def test_train_preflight_ignores_a_partial_checkpoint_dir(recipe, run):
    """An interrupted run leaves checkpoints/0 without checkpoint_best: training must resume, serving must not."""
    from dspark_kit.stages.preflight.checks import PreflightError, enforce

    (run / "checkpoints" / "checkpoint_best").unlink()
    enforce(Resolved(recipe, run), "train")  # no error: the checkpoints are train's own output
    with pytest.raises(PreflightError, match=r"pitfall 8"):
        enforce(Resolved(recipe, run), "serve")


# ---- pitfall 11: a multi-node run only one machine can reach ----------------
# (10.0.0.1 is never contacted: the interface is named, so nothing is looked up)


def _errors11(recipe, run) -> list[str]:
    return [f.message for f in run_preflight(Resolved(recipe, run), probes=False) if f.pitfall == 11 and f.level == "error"]


def test_pitfall_11_two_nodes_loopback_master(recipe, run):
    recipe.train.nnodes = 2
    assert any("train.master_addr 127.0.0.1 is loopback" in m for m in _errors11(recipe, run))
    recipe.train.nodes_same_host = True  # a local simulation: loopback is right
    assert _errors11(recipe, run) == []


def test_pitfall_11_two_nodes_lo_interface(recipe, run):
    recipe.train.nnodes, recipe.train.master_addr, recipe.train.socket_ifname = 2, "10.0.0.1", "lo"
    assert any("GLOO_SOCKET_IFNAME=lo" in m for m in _errors11(recipe, run))
    recipe.train.socket_ifname = "eth0"
    assert _errors11(recipe, run) == []


def test_pitfall_11_two_nodes_node_local_hidden_state_storage(recipe, run):
    recipe.train.nnodes, recipe.train.master_addr, recipe.train.socket_ifname = 2, "10.0.0.1", "eth0"
    recipe.hidden_states.backend, recipe.hidden_states.storage_path = "vllm", "/tmp/hidden_states"
    assert _errors11(recipe, run) == []  # a server per node writes and reads on its own machine
    recipe.hidden_states.endpoint = "http://10.0.0.1:9736"  # one server for both nodes
    assert any("hidden_states.storage_path /tmp/hidden_states is node-local" in m for m in _errors11(recipe, run))
    recipe.hidden_states.storage_shared = True
    assert _errors11(recipe, run) == []
    recipe.train.nnodes, recipe.hidden_states.storage_shared = 1, False  # one node: /tmp is fine
    assert _errors11(recipe, run) == []


def test_preflight_refuses_an_engine_that_cannot_serve_the_checkpoint(tmp_path):
    """The engine gate (docs/COMPAT.md) is a preflight finding, as in serve's plan."""
    from dspark_kit.recipe import recipe_from_dict
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.preflight.checks import _context, check_engine

    r = recipe_from_dict({"verifier": {"num_hidden_layers": 8}, "train": {"device": "cuda"},
                          "serve": {"engine": "vllm"}})

    def codes(**installed):
        return [f.code for f in check_engine(_context(Resolved(r, tmp_path, planning=True, installed=installed)))]

    assert codes(vllm="0.26.0") == ["engine"]  # rewrites to the bonus anchor
    assert codes(vllm="0.30.0") == [] and codes() == []  # serves it; not installed here: nothing to refuse
    r.serve.adaptive_verification, r.serve.enforce_eager = "on", True
    assert codes(vllm="0.30.0") == ["adaptive-verification"]


def _verifier_dir(tmp_path, *, weights=True, tokenizer=True, shards=None, heads=4):
    import json as _json

    d = tmp_path / "verifier"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(_json.dumps({"num_hidden_layers": 8, "hidden_size": 64,
                                                "num_attention_heads": heads, "vocab_size": 1000}))
    if weights:
        (d / "model.safetensors").write_bytes(b"")
    if shards is not None:
        (d / "model.safetensors.index.json").write_text(_json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
        (d / shards[0]).write_bytes(b"")
    if tokenizer:  # a real (word-level) tokenizer with a mask token, so the mask check passes
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel

        vocab = {w: i for i, w in enumerate(["<unk>", "<mask>", "hello", "world"])}
        Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(_json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "unk_token": "<unk>", "mask_token": "<mask>"}))
    return d


@pytest.mark.parametrize("case,code", [
    ("config-only", "verifier-weights"), ("missing-shard", "verifier-shards"), ("no-tokenizer", "verifier-tokenizer"),
    ("nonexistent", "verifier-missing"), ("tp-3-on-2", "tensor-parallel"), ("tp-not-dividing-heads", "tensor-parallel"),
    ("regen-too-long", "max-model-len"), ("bench-too-long", "max-model-len"),
])
def test_preflight_catches_what_would_fail_at_load(tmp_path, case, code):
    """Each mistake fails preflight with one line naming the key, before anything loads."""
    from dspark_kit.recipe import recipe_from_dict
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.preflight.checks import run_preflight

    v = _verifier_dir(tmp_path, weights=case not in ("config-only", "missing-shard"), tokenizer=case != "no-tokenizer",
                      shards=("s-1.safetensors", "s-2.safetensors") if case == "missing-shard" else None,
                      heads={"tp-not-dividing-heads": 6, "tp-3-on-2": 6}.get(case, 4))
    serve = {"max_model_len": 256, "tensor_parallel_size": 1}
    if case == "tp-3-on-2":
        serve |= {"tensor_parallel_size": 3, "devices": "0,1"}
    if case == "tp-not-dividing-heads":
        serve |= {"tensor_parallel_size": 4}
    data = {"verifier": {"path": "/nonexistent/verifier" if case == "nonexistent" else str(v)},
            "regen": {"max_tokens": 256 if case == "regen-too-long" else 64},
            "bench": {"max_tokens": 300 if case == "bench-too-long" else 64}, "serve": serve}
    findings = run_preflight(Resolved(recipe_from_dict(data), tmp_path / "run", planning=True), probes=False,
                             storage=False)
    errors = [f for f in findings if f.level == "error"]
    assert [f.code for f in errors] == [code], errors
    assert "\n" not in errors[0].message


def test_a_missing_verifier_on_a_recipe_for_another_machine_is_a_warning(tmp_path):
    """Planning the cluster on a laptop: an NPU recipe's verifier lives there, not here."""
    from dspark_kit.recipe import recipe_from_dict
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.preflight.checks import _context, check_verifier

    r = recipe_from_dict({"verifier": {"path": "/mnt/models/q", "num_hidden_layers": 8}, "train": {"device": "npu"}})
    [f] = check_verifier(_context(Resolved(r, tmp_path, planning=True)))
    assert f.level == "warning" and "runs on npu" in f.message and f.code == "verifier-missing"


def test_preflight_catches_a_relative_verifier_path_read_from_the_shell(tmp_path, monkeypatch):
    """A relative verifier.path is read from the recipe file's folder; one that exists only in the shell's
    directory is named (elsewhere it became a hub id: 24 s of retries, then transformers' error)."""
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.preflight.checks import run_preflight

    (tmp_path / "recipes").mkdir()
    _verifier_dir(tmp_path)  # tmp_path/verifier, beside the shell, not the recipe
    f = tmp_path / "recipes" / "r.yaml"
    f.write_text("verifier:\n  path: verifier\ntrain:\n  device: cpu\nserve:\n  max_model_len: 256\n"
                 "regen:\n  max_tokens: 64\nbench:\n  max_tokens: 64\n")
    monkeypatch.chdir(tmp_path)
    findings = run_preflight(Resolved(load_recipe(f), tmp_path / "run", planning=True), probes=False, storage=False)
    errors = [fd for fd in findings if fd.level == "error"]
    assert [fd.code for fd in errors] == ["verifier-relative"], errors
    assert "verifier.path verifier" in errors[0].message and "relative to the recipe" in errors[0].message
    # written relative to the recipe, it loads from any directory
    f.write_text(f.read_text().replace("path: verifier", "path: ../verifier"))
    monkeypatch.chdir(tmp_path / "recipes")
    findings = run_preflight(Resolved(load_recipe("r.yaml"), tmp_path / "run", planning=True), probes=False,
                             storage=False)
    assert not [fd for fd in findings if fd.level == "error"], findings


def test_preflight_refuses_a_cpu_recipe_whose_verifier_does_not_fit_memory(tmp_path, monkeypatch):
    """On CPU every stage holds the verifier in memory: an 8B in float32 (~35 GiB) on a 16 GiB laptop is
    refused before anything loads, naming train.device and the fix."""
    import json as _json

    from dspark_kit import devices
    from dspark_kit.recipe import recipe_from_dict
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.preflight.checks import run_preflight

    v = _verifier_dir(tmp_path)
    config = _json.loads((v / "config.json").read_text())
    (v / "config.json").write_text(_json.dumps({**config, "num_hidden_layers": 36, "hidden_size": 4096,
                                                "num_attention_heads": 32, "intermediate_size": 12288,
                                                "vocab_size": 151936}))
    monkeypatch.setattr(devices, "device_memory_bytes", lambda d: 16 * 2**30)
    r = recipe_from_dict({"verifier": {"path": str(v)}, "train": {"device": "cpu"}})
    errors = [f for f in run_preflight(Resolved(r, tmp_path / "run", planning=True), probes=False, storage=False)
              if f.level == "error"]
    assert [f.code for f in errors if f.code != "train-memory"] == ["verifier-memory"], errors  # + the plan's own
    errors = [f for f in errors if f.code == "verifier-memory"]
    assert errors[0].message.startswith("train.device cpu: the verifier (") and "16.0 GiB" in errors[0].message
    assert "train.device cuda" in errors[0].message and "\n" not in errors[0].message
    monkeypatch.setattr(devices, "device_memory_bytes", lambda d: 64 * 2**30)  # it fits: no finding
    assert not [f for f in run_preflight(Resolved(r, tmp_path / "run", planning=True), probes=False, storage=False)
                if f.code == "verifier-memory"]


def test_regen_prompts_longer_than_the_room_max_tokens_leaves(recipe, run):
    """Issue 29: regen.max_tokens plus the longest prompt must fit serve.max_model_len. Measured with the
    verifier's template on the data source's rows: a budget-breaking share is an error naming the fix,
    a few rows a warning, enough room nothing."""
    def room(max_model_len: int, max_tokens: int, budget: float = 0.05):
        recipe.serve.max_model_len, recipe.regen.max_tokens = max_model_len, max_tokens
        recipe.regen.max_failed_fraction = budget
        return [f for f in run_preflight(Resolved(recipe, run), probes=False) if f.code == "prompt-room"]

    assert room(512, 64) == []  # the shipped tiny recipe's lengths
    [tight] = room(96, 64)
    assert tight.level == "error" and "regen.max_tokens 64 that passes serve.max_model_len 96" in tight.message
    needed = int(tight.message.split("raise serve.max_model_len to ")[1].split()[0])
    assert needed > 96 and room(needed, 64) == []  # the fix it names is enough
    [few] = room(needed - 1, 64, budget=1.0)  # only the longest prompts pass it, within a generous budget
    assert few.level == "warning"


class _ModelsServer:
    """An external server's /v1/models listing `ids` (an OpenAI-compatible server the kit did not start)."""

    def __init__(self, ids: list[str]):
        import threading
        from http.server import BaseHTTPRequestHandler, HTTPServer

        body = json.dumps({"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}).encode()

        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/v1/models" else 404)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _endpoint_findings(tmp_path, *sets):
    from dspark_kit.recipe import load_recipe
    from dspark_kit.stages.preflight.checks import _Context, check_endpoints

    tiny = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"
    res = Resolved(load_recipe(tiny, list(sets)), tmp_path / "run", planning=True)
    return res, check_endpoints(_Context(res))


def test_external_hidden_state_server_must_list_the_verifier_path_first(tmp_path):
    """A user's own server started with only --served-model-name X: the trainer would refuse it
    late; preflight says so first, with the names to start it with."""
    srv = _ModelsServer(["my-model"])
    try:
        res, found = _endpoint_findings(tmp_path, "hidden_states.mode=online", f"hidden_states.endpoint={srv.url}")
        assert [(f.level, f.pitfall) for f in found] == [("error", 3)]
        assert "lists ['my-model'] first" in found[0].message
        assert f"--served-model-name {res.verifier_path}" in found[0].message
        srv.close()
        srv = _ModelsServer([res.verifier_path, "my-model"])
        _, found = _endpoint_findings(tmp_path, "hidden_states.mode=online", f"hidden_states.endpoint={srv.url}")
        assert found == []
    finally:
        srv.close()


def test_unreachable_external_endpoints_are_warnings(tmp_path):
    from dspark_kit.engines.ports import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens
    _, found = _endpoint_findings(tmp_path, "hidden_states.mode=online", f"hidden_states.endpoint={url}",
                                  f"regen.endpoints=[{url}]")
    assert [(f.level, f.pitfall) for f in found] == [("warning", 3), ("warning", 3)]
    assert all("cannot check its model names" in f.message for f in found)


def test_regen_endpoint_serving_another_model_is_a_warning(tmp_path):
    srv = _ModelsServer(["someone-elses-model"])
    try:
        _, found = _endpoint_findings(tmp_path, f"regen.endpoints=[{srv.url}]")
    finally:
        srv.close()
    assert [(f.level, f.pitfall) for f in found] == [("warning", 3)]
    assert "serves someone-elses-model first (what regen asks for)" in found[0].message
