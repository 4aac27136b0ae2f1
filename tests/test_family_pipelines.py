"""One short pipeline per tiny verifier family beyond the dense Qwen3 (whose runs the rest of the
suite covers): `dspark-kit run` of the family's recipe, regen to train, on the CPU; then the trained
draft's held-out acceptance against a freshly initialised draft's (greedy: deterministic; eval's own
function, so the eval stage's sweep of confidence cut-offs, which compares nothing here, is left to
the dense Qwen3's runs), and the trained draft through vLLM's own DSpark loader with the family's
verifier as the target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ["qwen3-moe", "llama3", "gpt-oss"]
# lean: few rows; the demo recipes train on more (the closing note's figures)
SETS = ["data.limit=96", "train.max_anchors=32", "train.epochs=6", "regen.max_tokens=48"]
# a Harmony reply is its analysis channel and then its final one: room for both, or regen cuts it;
# fewer rows and epochs (its draft still passes the margin twice over: 4.3 vs 1.07 at 96 rows, 6 epochs)
FAMILY_SETS = {"gpt-oss": ["regen.max_tokens=96", "data.limit=64", "train.epochs=4"]}


def _sets(name: str) -> list[str]:
    return SETS + FAMILY_SETS.get(name, [])
# serve and bench are the local engine's, the same for every family: the demos run them
STAGES = "regen,prepare,hidden-states,train"
MARGIN = 2.0

pytestmark = pytest.mark.slow


def _recipe(name: str):
    from dspark_kit.recipe import load_recipe

    return load_recipe(REPO / f"recipes/tiny-{name}-cpu.yaml", _sets(name))


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, tmp_path_factory) -> tuple[str, Path]:
    """The family recipe's pipeline (`dspark-kit run`, the real CLI): regen through the local engine,
    prepare, hidden states, train."""
    name = request.param
    wd = tmp_path_factory.mktemp(f"{name}-run")
    sets = [a for s in _sets(name) for a in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "dspark_kit", "run", str(REPO / f"recipes/tiny-{name}-cpu.yaml"),
                           "--stages", STAGES, "--workdir", str(wd), "--json", *sets], capture_output=True, text=True, timeout=3600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (wd / "checkpoints").is_dir(), proc.stdout[-2000:]
    return name, wd


def test_the_familys_trained_draft_beats_an_untrained_one(family_run, tmp_path):
    from fixtures_decoder import fresh_draft, save_draft

    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.evaluation.evaluate import evaluate_checkpoint

    name, wd = family_run
    recipe = _recipe(name)
    untrained_ckpt = save_draft(fresh_draft(Resolved(recipe, wd).verifier_path, draft_arch=recipe.draft.arch,
                                            mask_token_id=recipe.draft.mask_token_id), tmp_path / "untrained")
    # the fixed K alone: the confidence cut-offs' decodes (three more per draft) compare nothing here
    kw = {"num_prompts": 8, "max_new_tokens": 32, "context_lengths": [], "categories": [], "budget_thresholds": ()}
    al = {which: evaluate_checkpoint(Resolved(recipe, wd, checkpoint=ckpt, window="off"), out_dir=tmp_path / which,
                                     **kw)["acceptance_length"]
          for which, ckpt in (("trained", None), ("untrained", untrained_ckpt))}
    print(f"\n[{name}] held-out acceptance length: trained {al['trained']:.2f}, untrained {al['untrained']:.2f}")
    assert al["trained"] >= MARGIN * al["untrained"], al


def test_preflight_passes_the_run_and_refuses_a_mask_token_the_verifier_emitted(family_run, tmp_path):
    import shutil

    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.preflight.checks import run_preflight

    name, wd = family_run
    run = tmp_path / "run"
    shutil.copytree(wd, run, ignore=shutil.ignore_patterns("hidden_states", "hs-storage"))
    recipe = _recipe(name)
    assert not [f for f in run_preflight(Resolved(recipe, run), probes=False) if f.code.startswith("pitfall-7")]
    from transformers import AutoTokenizer

    mask = recipe.draft.mask_token_id  # else the tokenizer's own (Qwen's <|MASK|>), as preflight resolves it
    mask = AutoTokenizer.from_pretrained(Resolved(recipe, run).verifier_path).mask_token_id if mask is None else mask
    with (run / "regen.jsonl").open("a") as f:  # a reply the verifier "generated" with the mask token in it
        f.write(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                              {"from": "gpt", "value": "x", "token_ids": [mask]}]}) + "\n")
    found = [f for f in run_preflight(Resolved(recipe, run), probes=False) if f.level == "error"]
    assert any("replies the verifier generated" in f.message for f in found), found


@pytest.mark.vllm_real
def test_the_familys_draft_loads_whole_through_vllm(family_run, vllm_cpu_build):
    """`contract`: vLLM's DSpark config loader, engine config and load_weights, the family as target."""
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.evaluation.decode_contract import contract_check

    name, wd = family_run
    res = Resolved(_recipe(name), wd)
    [c] = contract_check(res)["checkpoints"]
    assert c["findings"] == [], c["findings"]
    cfg, loaded = c["vllm_view"]["config"], c["vllm_view"]["load_weights"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == res.recipe.target_layer_ids(res.num_hidden_layers)
    assert cfg["mask_token_id"] == json.loads((res.checkpoint / "config.json").read_text())["mask_token_id"]
    assert loaded["missing"] == []
