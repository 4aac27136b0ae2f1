"""The model ids each server answers to (Resolved.served_names).

speculators' online trainer and `generate-offline-data` read the first id of the extraction
server's /v1/models and refuse it unless it equals the model they were given (the trainer:
--verifier-name-or-path). The seed recipe sets verifier.served_name, so its hidden-states
server must answer to the verifier's path first and to the served name as well.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from dspark_kit.engines.local.api import ApiError, CompletionRequest
from dspark_kit.engines.local.server import Engine, create_app, parse_args
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.hidden.hidden_states_vllm import offline_command
from dspark_kit.stages.server_plan import server_plan
from dspark_kit.stages.training.train import plan as plan_train

REPO = Path(__file__).resolve().parent.parent
SEED = REPO / "recipes" / "qwen3-30b-a3b-ultrachat-ascend.yaml"
SEED_VERIFIER = "/mnt/cephfs/models/Qwen3-30B-A3B/Qwen/Qwen3-30B-A3B"
URL = "http://127.0.0.1:9736"


def seed_resolved(tmp_path: Path, *sets: str) -> Resolved:
    """The seed recipe planned on this machine (nothing built; the verifier is named by its path)."""
    return Resolved(load_recipe(SEED, list(sets)), tmp_path / "run", planning=True,
                    installed={"vllm-ascend": "0.27.1rc1", "vllm": "0.32.0"}, window_support="yes")


def served_model_names(argv: list[str]) -> list[str]:
    """The values of --served-model-name (several, as vLLM's nargs='+')."""
    i = argv.index("--served-model-name") + 1
    names = []
    while i < len(argv) and not argv[i].startswith("--"):
        names.append(argv[i])
        i += 1
    return names


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("sets", [[], ["serve.engine=vllm"], ["serve.engine=local", "train.device=cpu"]],
                         ids=["vllm-ascend", "vllm", "local"])
def test_seed_hidden_states_server_answers_first_to_the_trainers_verifier(tmp_path, sets):
    res = seed_resolved(tmp_path, *sets)
    assert res.recipe.verifier.served_name == "qwen3-30b-a3b"  # what made the trainer refuse the server
    names = served_model_names(server_plan(res, "hidden-states", port=9736).argv)
    trainer = plan_train(res).process("trainer").launch.argv
    offline = offline_command(res, URL)
    assert names == [SEED_VERIFIER, "qwen3-30b-a3b"]
    assert names[0] == flag(trainer, "--verifier-name-or-path") == flag(offline, "--model")
    # the other roles answer to the name clients ask for (regen, bench, serve)
    for role in ("chat", "spec"):
        assert served_model_names(server_plan(res, role, port=8014).argv) == ["qwen3-30b-a3b"], role


def test_without_a_served_name_every_server_answers_to_the_verifier_path(tmp_path):
    res = seed_resolved(tmp_path, "verifier.served_name=null")
    for role in ("chat", "hidden-states", "spec"):
        assert res.served_names(role) == [SEED_VERIFIER], role
    assert served_model_names(server_plan(res, "hidden-states", port=9736).argv) == [SEED_VERIFIER]


def test_hidden_states_dry_run_pairs_the_server_with_generate_offline_data(tmp_path):
    """backend vllm, offline: the printed server and generate-offline-data agree on the model."""
    from dspark_kit.stages.hidden.hidden_states_vllm import offline_processes

    res = seed_resolved(tmp_path, "hidden_states.mode=offline")
    lines = offline_processes(res)[0]
    server = shlex.split(next(line for line in lines if " vllm serve " in line))
    offline = shlex.split(next(line for line in lines if "generate-offline-data" in line))
    assert served_model_names(server)[0] == flag(offline, "--model") == SEED_VERIFIER


# ---- the local engine answers to every name, as vLLM ----------------------------------------


class _Tokenizer:
    eos_token_id = 2

    def convert_tokens_to_ids(self, token: str) -> int:
        return 1


def _engine(*names: str) -> Engine:
    argv = ["--model", "/models/v", "--role", "hidden-states", "--layer-ids", "1,2", "--storage-path", "/tmp/x"]
    args = parse_args(argv + (["--served-model-name", *names] if names else []))
    config = SimpleNamespace(max_position_embeddings=64, vocab_size=8)
    return Engine(args, None, _Tokenizer(), object(), config=config)


def test_local_engine_answers_to_each_served_name_and_404s_another():
    engine = _engine("/models/v", "alias")
    assert engine.served_name == "/models/v"  # the first names replies and metrics, as vLLM
    for name in ("/models/v", "alias", None):
        engine.check_model(CompletionRequest(prompt=[1], model=name))
    with pytest.raises(ApiError) as e:
        engine.check_model(CompletionRequest(prompt=[1], model="other"))
    assert e.value.status == 404 and "`/models/v`, `alias`" in str(e.value)
    models = TestClient(create_app(engine)).get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["/models/v", "alias"]  # speculators reads data[0].id
    assert {m["root"] for m in models} == {"/models/v"}


def test_local_engine_without_a_served_name_answers_to_its_model():
    engine = _engine()
    assert engine.served_names == ["/models/v"]
    models = TestClient(create_app(engine)).get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["/models/v"]
