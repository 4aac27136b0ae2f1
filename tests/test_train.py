"""The speculators train command is built from the recipe, never typed by hand."""

import json
import shlex
from pathlib import Path

import pytest

from dspark_kit.recipe import load_recipe
from dspark_kit.stages.training.train import build_train_args, launch_plan, node_plans

REPO = Path(__file__).resolve().parent.parent
SEED = "/mnt/cephfs/models/Qwen3-30B-A3B/Qwen/Qwen3-30B-A3B"


def _flag(args, name):
    i = args.index(name)
    vals = []
    for a in args[i + 1:]:
        if a.startswith("--"):
            break
        vals.append(a)
    return vals


@pytest.fixture()
def ascend():
    return load_recipe(REPO / "recipes" / "qwen3-30b-a3b-ultrachat-ascend.yaml")


def test_seed_training_flags_all_appear(ascend, tmp_path):
    args = build_train_args(ascend, tmp_path, verifier_path=SEED, num_hidden_layers=48, device="npu", hidden_states_dtype="bfloat16",
                            hidden_states_endpoint="http://localhost:9736")
    expect = {
        "--speculator-type": ["dspark"], "--block-size": ["8"], "--max-anchors": ["256"],
        "--target-layer-ids": ["1", "12", "23", "34", "45"], "--epochs": ["2"], "--checkpoint-freq": ["1"],
        "--lr": ["0.0003"], "--on-missing": ["generate"], "--seed": ["42"],
        "--num-layers": ["5"], "--draft-arch": ["qwen3"], "--mask-token-id": ["151669"],
        "--markov-rank": ["256"], "--markov-head-type": ["vanilla"], "--confidence-head-alpha": ["1.0"],
        "--full-attention-indices": ["0", "1", "2", "3", "4"], "--logger": ["tensorboard"],
        "--draft-attn-impl": ["sdpa"], "--total-seq-len": ["8192"],
        "--vllm-endpoint": ["http://localhost:9736/v1"], "--verifier-name-or-path": [SEED],
    }
    for flag, vals in expect.items():
        assert _flag(args, flag) == vals, flag
    assert json.loads(_flag(args, "--loss-fn")[0]) == {"ce": 0.7, "tv": 0.3}
    assert "--enable-confidence-head" in args and "--confidence-head-with-markov" in args
    assert _flag(args, "--data-path") == [str(tmp_path / "prepared")]


def test_args_parse_with_speculators_own_resolver(ascend, tmp_path):
    """...without a warning: speculators 0.9 warns on every run given --on-generate (deprecated, no effect)."""
    import warnings

    from speculators.train.config import TrainConfig

    args = build_train_args(ascend, tmp_path, verifier_path=SEED, num_hidden_layers=48, device="cpu", hidden_states_dtype="bfloat16",
                            hidden_states_endpoint="http://h:1/v1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cfg = TrainConfig.resolve(args).flatten()
    assert cfg["on_missing"] == "generate" and cfg["max_consecutive_generation_failures"] == 1
    assert cfg["speculator_type"] == "dspark" and cfg["block_size"] == 8
    assert cfg["full_attention_indices"] == [0, 1, 2, 3, 4] and cfg["target_layer_ids"] == [1, 12, 23, 34, 45]
    assert cfg["optimizer"] == "adamw" and cfg["draft_attn_impl"] == "sdpa" and cfg["loss_implementation"] == "eager"


def test_memory_keys_map_to_the_installed_trainer_flags(ascend, tmp_path):
    """train.gradient_checkpointing / train.fsdp_shard land on the installed TrainConfig's own fields."""
    from speculators.train.config import TrainConfig

    ascend.train.gradient_checkpointing, ascend.train.fsdp_shard = True, True
    args = build_train_args(ascend, tmp_path, verifier_path=SEED, num_hidden_layers=48, device="cpu",
                            hidden_states_dtype="bfloat16", hidden_states_endpoint="http://h:1/v1")
    cfg = TrainConfig.resolve(args).flatten()
    assert cfg["gradient_checkpointing"] is True and cfg["fsdp_shard"] is True
    ascend.train.gradient_checkpointing, ascend.train.fsdp_shard = False, False
    args = build_train_args(ascend, tmp_path, verifier_path=SEED, num_hidden_layers=48, device="cpu",
                            hidden_states_dtype="bfloat16", hidden_states_endpoint="http://h:1/v1")
    cfg = TrainConfig.resolve(args).flatten()
    assert cfg["gradient_checkpointing"] is False and cfg["fsdp_shard"] is False
    assert "--gradient-checkpointing" not in args and "--fsdp-shard" not in args


def test_memory_keys_refused_on_a_release_without_them(ascend, tmp_path, monkeypatch):
    from dspark_kit.compat import versions
    from dspark_kit.recipe import RecipeError

    monkeypatch.setattr(versions, "speculators_option", lambda command, flag: "absent")
    ascend.train.gradient_checkpointing = True
    with pytest.raises(RecipeError, match=r"^train.gradient_checkpointing: .*--gradient-checkpointing.*false$"):
        build_train_args(ascend, tmp_path, verifier_path=SEED, num_hidden_layers=48, device="cpu",
                         hidden_states_dtype="bfloat16", hidden_states_endpoint="http://h:1/v1")


def test_fsdp_shard_needs_several_ranks(tiny_recipe):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="train.fsdp_shard"):
        tiny_recipe.model_validate({**tiny_recipe.model_dump(), "train": {"fsdp_shard": True}})


def test_torchrun_and_ascend_env(ascend, tmp_path):
    plan = launch_plan(ascend, ["--x"], "npu")
    line = plan.shell_line()
    assert "torch.distributed.run" in plan.argv and "--nproc_per_node=2" in plan.argv
    assert plan.env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1" and "CUDA_VISIBLE_DEVICES" not in plan.env
    assert plan.env["HCCL_OP_EXPANSION_MODE"] == "AIV"
    assert shlex.split(line)[-1] == "--x" and "dspark_kit.compat.train_entry" in line


def test_multinode_prints_one_command_per_node(ascend):
    ascend.train.nnodes, ascend.train.master_addr, ascend.train.socket_ifname = 2, "10.0.0.1", "eth0"
    ascend.train.rdzv_backend = "static"
    plans = node_plans(ascend, [], "npu")
    assert [p.argv[p.argv.index("--nnodes=2") + 1] for p in plans] == ["--node_rank=0", "--node_rank=1"]
    assert all("--master_addr=10.0.0.1" in p.argv for p in plans)
    assert all(p.env["HCCL_SOCKET_IFNAME"] == p.env["GLOO_SOCKET_IFNAME"] == "eth0" for p in plans)
    ascend.train.rdzv_backend = "auto"  # across nodes: c10d; only node 0 hosts the store
    plans = node_plans(ascend, [], "npu")
    assert "--rdzv-endpoint=10.0.0.1:29500" in plans[0].argv and "--rdzv-endpoint=10.0.0.1:29500" in plans[1].argv
    assert [a.rsplit("is_host=", 1)[-1] for p in plans for a in p.argv if "is_host=" in a] == ["true", "false"]


def test_multinode_loopback_master_stops_the_plan(ascend):
    from dspark_kit.distributed.rendezvous import RendezvousError

    ascend.train.nnodes = 2
    with pytest.raises(RendezvousError, match="loopback"):
        node_plans(ascend, [], "npu")


def test_sliding_attention_passes_only_listed_layers(tiny_recipe, tmp_path):
    tiny_recipe.draft.attention = "sliding"
    tiny_recipe.draft.num_layers = 3
    tiny_recipe.draft.full_attention_indices = [0]
    args = build_train_args(tiny_recipe, tmp_path, verifier_path="v", num_hidden_layers=4, device="cpu", hidden_states_dtype="bfloat16")
    assert _flag(args, "--full-attention-indices") == ["0"] and _flag(args, "--on-missing") == ["raise"]


def test_online_without_endpoint_is_an_error(ascend, tmp_path):
    with pytest.raises(ValueError, match="hidden_states.mode online"):
        build_train_args(ascend, tmp_path, verifier_path=SEED, num_hidden_layers=48, device="npu", hidden_states_dtype="bfloat16")


def test_logger_none_is_left_to_speculators_default(tiny_recipe, tmp_path):
    tiny_recipe.train.logger = "none"
    args = build_train_args(tiny_recipe, tmp_path, verifier_path="v", num_hidden_layers=4, device="cpu", hidden_states_dtype="bfloat16")
    assert "--logger" not in args


def test_half_written_epochs_are_set_aside_for_resume(tmp_path):
    from dspark_kit.stages.training.train import set_aside_incomplete_checkpoints

    ck = tmp_path / "checkpoints"
    for epoch, whole in ((0, True), (1, False)):
        d = ck / str(epoch)
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
        if whole:
            (d / "training_state.json").write_text("{}")
    (ck / "epoch0_end").symlink_to("0")
    (ck / "incomplete-1").mkdir()  # an earlier crash at the same epoch is kept too
    moved = set_aside_incomplete_checkpoints(ck)
    assert [p.name for p in moved] == ["incomplete-1-1"]
    assert (ck / "0").is_dir() and not (ck / "1").exists() and (ck / "incomplete-1-1" / "model.safetensors").exists()
    assert set_aside_incomplete_checkpoints(ck) == []


def test_torchrun_restart_sets_half_written_epochs_aside_on_rank_0_only(tmp_path, monkeypatch):
    from dspark_kit.compat.train_entry import _set_aside_half_written

    ck = tmp_path / "checkpoints"
    (ck / "0").mkdir(parents=True)
    (ck / "0" / "training_state.json").write_text("{}")
    (ck / "1").mkdir()  # a worker died mid-save
    argv = ["--data-path", "x", "--save-path", str(ck)]
    monkeypatch.setenv("RANK", "1")
    _set_aside_half_written(argv)
    assert (ck / "1").exists()
    monkeypatch.setenv("RANK", "0")
    _set_aside_half_written(argv)
    assert not (ck / "1").exists() and (ck / "incomplete-1").is_dir() and (ck / "0").is_dir()


OLD_SPECULATORS = """parser.add_argument("--on-generate", choices=["delete", "keep"], default="delete")"""
NEW_SPECULATORS = """on_generate: Literal["delete"] = Field(default="delete")
warnings.warn("--on-generate is deprecated and has no effect: files are always deleted")
max_consecutive_generation_failures: int = Field(default=20)"""


@pytest.mark.parametrize("source,on_generate,breaker", [
    (OLD_SPECULATORS, True, False),  # a release that reads --on-generate and has no circuit breaker
    (NEW_SPECULATORS, False, True),  # 0.9: deprecated (ignored with a FutureWarning)
    (None, True, True),  # not installed here (a dry run on a laptop): the seed's flags
], ids=["reads-on-generate", "0.9-deprecated", "not-installed"])
def test_online_flags_follow_the_installed_speculators(ascend, tmp_path, monkeypatch, source, on_generate, breaker):
    from dspark_kit.compat import versions

    monkeypatch.setattr(versions, "_speculators_source", lambda command: source)
    args = build_train_args(ascend, tmp_path, verifier_path=SEED, num_hidden_layers=48, device="npu", hidden_states_dtype="bfloat16",
                            hidden_states_endpoint="http://localhost:9736")
    assert ("--on-generate" in args) == on_generate and ("--max-consecutive-generation-failures" in args) == breaker
    if on_generate:
        assert _flag(args, "--on-generate") == ["delete"]


def test_installed_speculators_options_are_detected():
    from dspark_kit.compat.versions import speculators_option

    assert speculators_option("train", "--on-generate") == "deprecated"  # speculators 0.9.0
    assert speculators_option("train", "--vllm-endpoint") == "reads"
    assert speculators_option("train", "--no-such-flag") == "absent"
    assert speculators_option("generate-offline-data", "--fail-on-error") == "reads"


def test_train_failure_names_the_stage_once(tmp_path, monkeypatch):
    """`dspark-kit train` prefixes the stage's error with the stage name; the error itself does not."""
    import dataclasses

    from typer.testing import CliRunner

    from dspark_kit.cli import app
    from dspark_kit.compat.train_entry import REFUSAL_PREFIX
    from dspark_kit.stages import steps
    from dspark_kit.stages.training.train import training_failure

    log = tmp_path / "train.log"
    log.write_text(f"{REFUSAL_PREFIX}speculators fix x: probe failed: Boom: no\n")

    from dspark_kit.stages.plan import StagePlan

    def refused(res, plan, reporter):  # what train.run raises when the trainer exits with a fix probe's refusal
        raise RuntimeError(training_failure(3, log))

    def planned(res):  # no verifier to look at: the plan is not what this test is about
        return StagePlan("train", [])

    monkeypatch.setitem(steps.REGISTRY, "train", dataclasses.replace(steps.REGISTRY["train"], run=refused,
                                                                     plan=planned))
    r = CliRunner().invoke(app, ["train", "-w", str(tmp_path / "run")])
    assert r.exit_code == 1, r.output
    assert r.output.strip().splitlines()[-1] == "error: train: speculators fix x: probe failed: Boom: no"


# A trainer that answers SIGTERM as speculators does: saves, then exits 0. It touches argv[1] once
# its handler is in place (the watch fires only then).
_SAVES_ON_SIGTERM = (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: (print('Interrupt checkpoint saved', flush=True), sys.exit(0)))\n"
    "pathlib.Path(sys.argv[1]).touch()\n"
    "time.sleep(60)\n")


@pytest.mark.slow  # starts a trainer stand-in
def test_a_trainer_stopped_by_the_watch_is_a_failure_even_when_it_exits_0(tmp_path):
    """The watch stops the trainer when its hidden-state server dies; speculators then saves an
    "interrupted" checkpoint and exits 0, which must not read as a finished training."""
    import sys

    from dspark_kit.engines import LaunchPlan
    from dspark_kit.stages.training.train import run_training

    log, started = tmp_path / "train.log", tmp_path / "started"
    reason = "the hidden-state server http://x exited with code -9"

    def gone():  # the server "dies" once the trainer runs
        return reason if started.exists() else None

    plan = LaunchPlan([sys.executable, "-c", _SAVES_ON_SIGTERM, str(started)])
    assert run_training(plan, log, watch=gone) == (0, reason)  # exit 0, and still the server's death
    assert "Interrupt checkpoint saved" in log.read_text()  # it was asked, not killed


@pytest.mark.slow
def test_a_watch_that_never_fires_leaves_the_exit_code(tmp_path):
    import sys

    from dspark_kit.engines import LaunchPlan
    from dspark_kit.stages.training.train import run_training

    plan = LaunchPlan([sys.executable, "-c", "raise SystemExit(3)"])
    assert run_training(plan, tmp_path / "t.log", watch=lambda: None) == (3, None)
    assert run_training(plan, tmp_path / "t.log") == (3, None)  # offline: nothing to watch


def test_the_run_waits_on_the_plans_rendezvous(ascend, tmp_path):
    """The rendezvous is decided once, at plan: the plan records it and the run rebuilds that same
    decision from the plan (it does not read the host again)."""
    import inspect
    import json

    from dspark_kit.distributed.rendezvous import Rendezvous, rendezvous_for
    from dspark_kit.stages.training import train

    ascend.train.nnodes, ascend.train.master_addr, ascend.train.socket_ifname = 2, "10.0.0.1", "eth0"
    rdzv = rendezvous_for(ascend, "npu")
    recorded = json.loads(json.dumps(rdzv.as_dict()))  # as DIR/plans/train.json holds it
    assert Rendezvous.from_dict(recorded) == rdzv
    assert "rendezvous_for" not in inspect.getsource(train.run) and 'details.get("rendezvous")' in inspect.getsource(train.run)


def test_an_interrupted_save_written_by_this_run_means_the_training_is_unfinished(tmp_path):
    """speculators saves `interrupted` and exits 0 on a SIGINT/SIGTERM from outside the kit (seen:
    a SmolLM2 run stopped in epoch 4 of 8 was recorded as done); only a save from this run counts:
    one an earlier run left is adopted or set aside (adopt_interrupted) before training starts."""
    from dspark_kit.specdec.checkpoints import adopt_interrupted
    from dspark_kit.stages.training.train import stopped_from_outside

    ckpts = tmp_path / "checkpoints"
    (ckpts / "2").mkdir(parents=True)
    assert stopped_from_outside(ckpts) is None  # whole epochs only: a finished training
    (ckpts / "interrupted").mkdir()
    line = stopped_from_outside(ckpts)
    assert line is not None and "interrupted" in line and "Rerun the same command to resume" in line
    assert adopt_interrupted(ckpts) is not None  # what run() does first: an earlier run's save moves away
    assert not (ckpts / "interrupted").exists()
    assert stopped_from_outside(ckpts) is None
