"""The Slurm batch script and the job's end, without a cluster (tests/test_slurm.py runs them on one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.launchers import slurm_job
from dspark_kit.launchers.slurm_job import JobEnd, ending, follow, make_job
from dspark_kit.launchers.slurm_script import batch_script, topology
from dspark_kit.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-cpu.yaml"
ASCEND = REPO / "recipes" / "qwen3-30b-a3b-ultrachat-ascend.yaml"


def _job(tmp_path, sets, path=TINY, command="run", **kw):
    r = load_recipe(path, sets)
    return make_job(r, path, tmp_path / "run", sets, command, **kw)


def _steps(script: str) -> list[str]:
    return [ln for ln in script.splitlines() if ln.startswith("srun ")]


def test_two_trainer_nodes_take_rank_and_master_from_the_allocation(tmp_path):
    script = batch_script(_job(tmp_path, ["train.nnodes=2", "regen.enabled=false"]))
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert f"#SBATCH --output={tmp_path / 'run' / 'logs' / 'slurm-%j.out'}" in script
    assert 'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in script
    pre, train, post = _steps(script)
    assert "--stages prepare,hidden-states" in pre and '--nodelist="${NODES[0]}"' in pre
    assert '--nodes=2' in train and '--nodelist="${NODES[0]},${NODES[1]}"' in train and "--kill-on-bad-exit=1" in train
    assert '--set train.node_rank="$SLURM_NODEID"' in train and "' train train -r" in train
    assert '--set train.master_addr="$MASTER"' in train and 'MASTER="${NODES[0]}"' in script
    assert "--stages eval,serve,bench,report" in post
    assert "export KIT=" in script  # the steps' bash -c reads it


def test_the_slurm_section_is_typed_and_becomes_sbatch_lines(tmp_path):
    script = batch_script(_job(tmp_path, ["slurm.partition=gpu", "slurm.account=proj", "slurm.time_limit=03:00:00",
                                          "slurm.gpus_per_node=8", "slurm.exclusive=true", "slurm.mem=0",
                                          "slurm.sbatch_args=[--constraint=h100]", "slurm.setup=[module load cann]"]))
    for line in ("--partition=gpu", "--account=proj", "--time=03:00:00", "--gpus-per-node=8", "--exclusive",
                 "--mem=0", "--constraint=h100"):
        assert f"#SBATCH {line}\n" in script, line
    assert "\nmodule load cann\n" in script
    with pytest.raises(RecipeError, match=r"slurm.partiton is not a recipe key \(did you mean slurm.partition\?\)"):
        load_recipe(TINY, ["slurm.partiton=gpu"])
    with pytest.raises(RecipeError, match="slurm.time_limit"):
        load_recipe(TINY, ["slurm.time_limit=3h"])


def test_an_extractor_node_of_its_own_serves_online_hidden_states_before_the_trainers(tmp_path):
    sets = ["hidden_states.mode=online", "slurm.extractor_nodes=1", "train.nnodes=2", "regen.enabled=false"]
    script = batch_script(_job(tmp_path, sets, command="train"))
    assert "#SBATCH --nodes=3" in script
    server, train = _steps(script)
    assert "serve --role hidden-states" in server and '--nodelist="${NODES[2]}"' in server and server.endswith("&")
    assert '--set serve.host="${NODES[2]}"' in server
    assert script.index("wait_url") < script.index(train) and 'HS_URL="$(wait_url' in script
    assert '--set hidden_states.endpoint="$HS_URL"' in train and '--nodelist="${NODES[0]},${NODES[1]}"' in train
    mooncake = batch_script(_job(tmp_path, [*sets, "hidden_states.transport=mooncake"], command="train"))
    assert mooncake.count('--set hidden_states.mooncake.master_host="${NODES[2]}"') == 2  # server and trainers
    assert "Mooncake master, then the hidden-state server" in mooncake


def test_a_topology_the_job_cannot_run_is_one_line_naming_the_key():
    with pytest.raises(RecipeError, match="slurm.extractor_nodes 1: .*set slurm.extractor_nodes: 0"):
        topology(load_recipe(TINY, ["slurm.extractor_nodes=1"]))  # offline hidden states
    with pytest.raises(RecipeError, match="train.nodes_same_host"):
        topology(load_recipe(TINY, ["train.nnodes=2", "train.nodes_same_host=true"]))


def test_the_job_holds_only_what_the_run_folder_leaves_to_run(tmp_path):
    from dspark_kit.stages.pipeline import stage_decisions

    sets = ["regen.enabled=false", "train.nnodes=2"]
    r = load_recipe(TINY, sets)
    decided = stage_decisions(r, {})
    state = {name: {"status": "done", "fingerprint": fp} for name, _, fp in decided[:3]}  # prepare, hidden-states
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.json").write_text(json.dumps(state))
    job = _job(tmp_path, sets)
    assert job.stages == ("train", "eval", "serve", "bench", "report")
    assert "prepare skipped (unchanged)" in batch_script(job)
    # where the nodes are is not what they compute: a new allocation's master keeps the fingerprints
    moved = load_recipe(TINY, [*sets, "train.master_addr=10.0.0.9", "train.node_rank=1",
                               "hidden_states.endpoint=http://n3:9736"])
    assert [fp for *_, fp in stage_decisions(moved, {})] == [fp for *_, fp in decided]
    changed = load_recipe(TINY, [*sets, "train.epochs=5"])
    assert [fp for *_, fp in stage_decisions(changed, {})][3] != decided[3][2]


def test_dry_run_prints_the_script_byte_for_byte(tmp_path):
    args = ["run", str(TINY), "--set", "train.nnodes=2", "-w", str(tmp_path / "run"), "--launcher", "slurm", "--dry-run"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    assert out.stdout == batch_script(_job(tmp_path, ["train.nnodes=2"]))
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


ASCEND_SETS = ["train.nnodes=2", "slurm.partition=ascend", 'slurm.time_limit="24:00:00"',
               "slurm.setup=[source /usr/local/Ascend/ascend-toolkit/set_env.sh]"]


def ascend_script() -> str:
    """The script docs/MULTINODE.md shows: the reference Ascend recipe on 2 nodes, the kit in /opt/dspark-kit."""
    from dataclasses import replace

    job = make_job(load_recipe(ASCEND, ASCEND_SETS), ASCEND, Path("/mnt/cephfs/runs/q30b"), ASCEND_SETS, "run")
    return batch_script(replace(job, python="/opt/dspark-kit/.venv/bin/python",
                                recipe_path=Path("/opt/dspark-kit/recipes") / ASCEND.name))


def test_the_ascend_reference_recipe_on_two_nodes_is_the_script_the_docs_show():
    script = ascend_script()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --partition=ascend" in script
    assert "each trainer node's `train` starts its own extraction server" in script  # online, no extractor node
    assert script in (REPO / "docs" / "MULTINODE.md").read_text(), "update docs/MULTINODE.md: print ascend_script()"


def test_a_failed_job_is_one_line_naming_the_node(tmp_path):
    out = tmp_path / "slurm-7.out"
    out.write_text("dspark-kit job 7 on n1 n2\ndspark-kit step: regen\nsrun: error: n1: task 0: Killed\n"  # a server stopped
                   "dspark-kit step: train\nsrun: error: n2: task 1: Killed\nsrun: Terminating StepId=7.1\n")
    code, line = ending(JobEnd("7", "FAILED", 137, "n[1-2]"), out, "dspark-kit run ... --launcher slurm")
    assert code == 137 and line.startswith("Slurm job 7 failed in step train on node n2 (task 1: Killed)"), line
    assert "`dspark-kit run ... --launcher slurm` resubmits it" in line and "\n" not in line
    out.write_text("dspark-kit step: train\nerror: train: speculators train exited with 1; see logs/train.log\n"
                   "srun: error: n1: task 0: Exited with exit code 1\nsrun: error: Node failure on n2\n")
    _, line = ending(JobEnd("7", "NODE_FAIL", 1, "n[1-2]", "NodeDown"), out, "again")
    assert line.startswith("Slurm job 7 failed in step train: node n2 was lost (it stopped answering, Slurm: "
                           "NodeDown): train: speculators train exited with 1"), line
    assert ending(JobEnd("7", "COMPLETED", 0, "n1"), out, "again") == (0, None)


def test_follow_relays_the_jobs_lines_and_returns_its_exit_code(tmp_path, monkeypatch):
    out = tmp_path / "slurm-3.out"
    states = iter([("PENDING", "", "", "Resources"), ("RUNNING", "", "n[1-2]", "None"),
                   ("RUNNING", "", "n[1-2]", "None"), ("FAILED", "0:9", "n[1-2]", "NonZeroExitCode")])

    def state(job_id):
        s = next(states)
        if s[0] == "RUNNING":
            with out.open("a") as f:
                f.write("train: epoch 1/2\n")
        return s

    monkeypatch.setattr(slurm_job, "job_state", state)
    seen: list[str] = []
    end = follow("3", out, seen.append, poll_s=0, sleep=lambda s: None)
    assert end.exit_code == 128 + 9 and end.state == "FAILED"
    assert seen == ["slurm: job 3 PENDING (Resources)", "  | train: epoch 1/2", "slurm: job 3 RUNNING on n[1-2]",
                    "  | train: epoch 1/2", "slurm: job 3 FAILED"]


def test_regen_on_several_nodes_starts_a_chat_server_on_each_and_waits_for_all(tmp_path):
    script = batch_script(_job(tmp_path, ["train.nnodes=2"]))
    servers = [s for s in _steps(script) if "serve --role chat" in s]
    assert [f'--nodelist="${{NODES[{i}]}}"' in s for i, s in enumerate(servers)] == [True, True]
    regen = next(s for s in _steps(script) if "--stages regen" in s)
    assert script.index('URL1="$(wait_url') < script.index(regen) < script.index("--stages prepare")
    assert '--set "regen.endpoints=[${ENDPOINTS%,}]"' in regen
    one = batch_script(_job(tmp_path, []))  # one node: regen starts its own server, as without Slurm
    assert "serve --role chat" not in one and "--stages regen,prepare,hidden-states" in one


def test_offline_vllm_hidden_states_run_on_every_trainer_node_each_its_shard(tmp_path):
    sets = ["train.nnodes=2", "hidden_states.backend=vllm", "regen.enabled=false"]
    script = batch_script(_job(tmp_path, sets, command="hidden-states"))
    [step] = _steps(script)
    assert "' hidden-states hidden-states -r" in step and '--nodelist="${NODES[0]},${NODES[1]}"' in step
    assert '--set train.node_rank="$SLURM_NODEID"' in step
    local = batch_script(_job(tmp_path, ["train.nnodes=2", "regen.enabled=false"], command="hidden-states"))
    assert "run --stages hidden-states" in local  # backend local: one process on node 0
