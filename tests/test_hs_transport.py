"""hidden_states.transport mooncake: one decision (master, store settings, who starts the master)
feeds the extraction server's connector, the trainer's flags, the dry run and preflight."""

import json
import shlex
import socket

from plan_helpers import plan_vllm

from dspark_kit.distributed.hs_transport import mooncake_for, transport_problems
from dspark_kit.recipe import recipe_from_dict
from dspark_kit.resolved import Resolved
from dspark_kit.stages.preflight.checks import _context, check_transport
from dspark_kit.stages.training.train import build_train_args

VERIFIER = "/models/Qwen3-0.6B"


def recipe(device="cpu", nnodes=1, **mooncake):
    return recipe_from_dict({
        "verifier": {"path": VERIFIER, "num_hidden_layers": 28}, "data": {"seq_length": 512},
        "train": {"device": device, "nnodes": nnodes, "master_addr": "10.0.0.5" if nnodes > 1 else "127.0.0.1"},
        "serve": {"engine": "vllm", "max_model_len": 512},
        "hidden_states": {"mode": "online", "transport": "mooncake", "mooncake": mooncake}})


def kv(argv):
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_one_decision_for_server_and_trainer(vllm_cpu_stub, tmp_path):
    r = recipe(master_port=50111, global_segment_gib=0.5)
    mc = mooncake_for(r)
    assert mc.master == "127.0.0.1:50111" and mc.start_on_node == 0 and mc.local_hostname == "127.0.0.1"
    cpu = kv(plan_vllm(r, "hidden-states", engine="vllm", installed_versions={}).argv)
    assert cpu["kv_connector"] == "CpuMooncakeHiddenStatesConnector"  # the kit's subclass on CPU
    store = cpu["kv_connector_extra_config"]["mooncake"]
    assert store["master_server_address"] == mc.master and store["global_segment_size"] == 2**29
    gpu = kv(plan_vllm(recipe(device="cuda", master_port=50111), "hidden-states", engine="vllm",
                       installed_versions={}).argv)
    assert (gpu["kv_connector"], gpu["kv_connector_module_path"]) == (
        "MooncakeHiddenStatesConnector", "hs_connectors.mooncake_hidden_states_connector")
    args = build_train_args(r, tmp_path, verifier_path=VERIFIER, num_hidden_layers=28, device="cpu", hidden_states_dtype="bfloat16",
                            hidden_states_endpoint="http://127.0.0.1:9736", mooncake=mc)
    assert args[args.index("--hidden-states-backend") + 1] == "mooncake"
    assert args[args.index("--mooncake-master") + 1] == "127.0.0.1:50111"
    assert args[args.index("--mooncake-global-segment-gib") + 1] == "0.5"


def test_trainer_flags_parse_with_speculators_own_resolver(tmp_path):
    from speculators.train.config import TrainConfig

    r = recipe(master_port=50111)
    args = build_train_args(r, tmp_path, verifier_path=VERIFIER, num_hidden_layers=28, device="cpu", hidden_states_dtype="bfloat16",
                            hidden_states_endpoint="http://127.0.0.1:9736", mooncake=mooncake_for(r))
    cfg = TrainConfig.resolve(args)
    assert cfg.flatten()["hidden_states_backend"] == "mooncake"
    assert cfg._backend_args["mooncake_master"] == "127.0.0.1:50111"  # hs_connectors' own argument


def test_dry_run_prints_one_line_per_node(vllm_cpu_stub, tmp_path):
    from dspark_kit.stages.hidden.hidden_states_vllm import offline_processes

    r = recipe(device="cuda", nnodes=3)
    lines = [line for line in offline_processes(Resolved(r, tmp_path, planning=True))[0] if line.startswith("# node ")]
    assert len(lines) == 3 and all("10.0.0.5:50051" in line for line in lines)
    assert "starts mooncake_master" in lines[0] and "starts mooncake_master" not in lines[1]


def test_problems_and_an_unreachable_master(vllm_cpu_stub, tmp_path):
    bad = recipe()
    bad.hidden_states.mode, bad.serve.engine = "offline", "local"
    assert [p.split(":")[1].split(";")[0].strip() for p in transport_problems(bad, mooncake_for(bad))] == [
        "only online training reads the store (offline hidden states are files in prepared/hidden_states)",
        "the local engine writes files only"]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = recipe(master_port=port, start_master=False)
    findings = check_transport(_context(Resolved(r, tmp_path, planning=True), checkpoints=False))
    assert len(findings) == 1 and findings[0].level == "error"
    assert f"no mooncake_master at 127.0.0.1:{port}" in findings[0].message
    assert not check_transport(_context(Resolved(recipe(master_port=port), tmp_path, planning=True),
                                        checkpoints=False))
    with socket.socket() as s:  # someone runs it: fine
        s.bind(("127.0.0.1", port))
        s.listen()
        assert not check_transport(_context(Resolved(r, tmp_path, planning=True), checkpoints=False))


def test_file_transport_is_unchanged(vllm_cpu_stub):
    r = recipe()
    r.hidden_states.transport = "file"
    assert mooncake_for(r) is None
    argv = plan_vllm(r, "hidden-states", engine="vllm", installed_versions={}).argv
    assert kv(argv)["kv_connector"] == "CpuHiddenStatesConnector" and "mooncake" not in shlex.join(argv)


def test_a_host_joins_as_its_address_on_the_route_to_the_master(monkeypatch):
    """Not the hostname's address (127.0.1.1 in many containers): the rendezvous's route rule."""
    from dspark_kit.distributed.hs_transport import LOCAL_HOSTNAME_ENV
    from dspark_kit.distributed.rendezvous import route_ip

    monkeypatch.delenv(LOCAL_HOSTNAME_ENV, raising=False)
    mc = mooncake_for(recipe(master_host="192.0.2.7"))  # TEST-NET-1: a route lookup, no packet
    routed, _ = route_ip("192.0.2.7", mc.port)
    assert routed and mc.local_hostname == routed and mc.env() == {LOCAL_HOSTNAME_ENV: routed}
    monkeypatch.setenv(LOCAL_HOSTNAME_ENV, "10.1.2.3")
    assert mc.local_hostname == "10.1.2.3"


def test_an_external_endpoint_means_the_master_runs_elsewhere(vllm_cpu_stub, tmp_path):
    """train with hidden_states.endpoint starts neither the server nor the master; it checks the master."""
    from dspark_kit.stages.training.train import plan as plan_train

    r = recipe(master_port=50111)
    assert mooncake_for(r).start_on_node == 0
    r.hidden_states.endpoint = "http://10.0.0.9:8100"
    assert mooncake_for(r).start_on_node is None
    roles = [p.role for p in plan_train(Resolved(r, tmp_path, planning=True)).processes]
    assert roles == ["trainer"]


def test_serve_hidden_states_starts_the_master_first(vllm_cpu_stub, tmp_path):
    from dspark_kit.stages.server_plan import checked_server

    sp = checked_server(Resolved(recipe(master_port=50111), tmp_path, planning=True), "hidden-states")
    assert sp.mooncake_master is not None and "--rpc_port=50111" in sp.mooncake_master.argv
    assert sp.mooncake_master.port == 50112  # healthy when its HTTP port answers
    assert kv(sp.plan.argv)["kv_connector_extra_config"]["mooncake"]["master_server_address"] == "127.0.0.1:50111"
    assert checked_server(Resolved(recipe(start_master=False), tmp_path, planning=True),
                       "hidden-states").mooncake_master is None
    no_mc = recipe()
    no_mc.hidden_states.transport = "file"
    assert checked_server(Resolved(no_mc, tmp_path, planning=True), "hidden-states").mooncake_master is None
