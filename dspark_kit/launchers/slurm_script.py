"""The batch script `--launcher slurm` submits: one job for the recipe's whole topology.

`batch_script(job)` is pure: the recipe, the stages still to run (the run folder's state, asked of
`stages.pipeline.stage_decisions`, the rule a local `run` follows) and the command line give the
same text every time, so `--dry-run` prints exactly the file that is submitted.

The topology (`topology`), in node order of the allocation (`scontrol show hostnames
"$SLURM_JOB_NODELIST"`):
- nodes 0..train.nnodes-1 train. Every node runs the kit itself (`dspark-kit train --set
  train.node_rank=$SLURM_NODEID --set train.master_addr=<node 0>`), so its torchrun line, device
  environment and network interface are decided on that node by the same functions as a local
  multi-node run (distributed/rendezvous.py: node 0 hosts the c10d store, each node its own
  interface and --local-addr). Each records the stage in the run folder's state as the stage
  command does; `--kill-on-bad-exit` ends every node's task when one fails.
- offline hidden states with backend vllm across nodes: each trainer node extracts its shard
  (the stage's own --world-size/--rank split).
- online hidden states with slurm.extractor_nodes 1: the extraction server has the next node to
  itself (`dspark-kit serve --role hidden-states`, which starts the Mooncake master first when the
  transport is Mooncake); the trainers start after the server printed its URL (it does once
  healthy) and read hidden states from that URL (hidden_states.endpoint, the Mooncake master on
  that node).
- regen with no regen.endpoints on several nodes: a chat server on every node (`dspark-kit serve
  --role chat`), regen on node 0 over all of them once each is healthy, then the servers stop.
- every other stage runs on node 0 (`run --stages ...`), in pipeline order.

A step that fails fails the job (`set -e`); background servers are stopped when the script exits.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dspark_kit.recipe import Recipe, RecipeError
from dspark_kit.rundir import RunDir

SCRIPT_NAME = "slurm-job.sbatch"  # in the run folder: the script last submitted
OUT_NAME = "slurm-%j.out"  # in DIR/logs: the job's own output (the kit's stage lines)


def job_out(logs: Path, job_id: str) -> Path:
    """The job's output file, as sbatch names it from OUT_NAME."""
    return logs / OUT_NAME.replace("%j", job_id)


@dataclass(frozen=True)
class Topology:
    trainer_nodes: int  # nodes 0..n-1 (train.nnodes)
    extractor_nodes: int  # after the trainers: the online extraction server's node
    mooncake: bool  # the extraction server starts the Mooncake master on its node

    @property
    def nodes(self) -> int:
        return self.trainer_nodes + self.extractor_nodes


def topology(recipe: Recipe) -> Topology:
    """Which node does what, from the recipe alone (RecipeError: one line naming the key)."""
    hs, s = recipe.hidden_states, recipe.slurm
    if s.extractor_nodes and (hs.mode != "online" or hs.endpoint):
        why = "an existing server (hidden_states.endpoint)" if hs.endpoint else "offline files (hidden_states.mode)"
        raise RecipeError(f"slurm.extractor_nodes {s.extractor_nodes}: the extraction server on a node of its own is "
                          f"for online hidden states the job starts, not {why}; set slurm.extractor_nodes: 0")
    if recipe.train.nodes_same_host and recipe.train.nnodes > 1:
        raise RecipeError("train.nodes_same_host: true simulates nodes on this machine; under Slurm each node is "
                          "a machine of the allocation: set train.nodes_same_host: false")
    return Topology(recipe.train.nnodes, s.extractor_nodes, s.extractor_nodes > 0 and hs.transport == "mooncake")


def spread(recipe: Recipe, stage: str) -> bool:
    """Whether `stage` runs on every trainer node (else on node 0 alone)."""
    hs = recipe.hidden_states
    if stage == "train":
        return recipe.train.nnodes > 1 or bool(recipe.slurm.extractor_nodes)
    if stage == "hidden-states":
        return recipe.train.nnodes > 1 and hs.mode == "offline" and hs.backend == "vllm"
    return False


@dataclass(frozen=True)
class SlurmJob:
    """What the script is made of: the command's own words, never re-derived inside the job."""

    recipe: Recipe
    recipe_path: Path  # absolute
    workdir: Path  # absolute
    sets: tuple[str, ...]  # the user's --set overrides, passed to every step as given
    stages: tuple[str, ...]  # the stages to run, in pipeline order (the rest are done or unselected)
    python: str  # the interpreter that runs the kit on every node (the submitting install)
    command: str = "run"  # the command that wrote it (run, train, hidden-states)
    skipped: tuple[str, ...] = field(default_factory=tuple)  # "stage: why" lines for the header


def sbatch_lines(job: SlurmJob, topo: Topology) -> list[str]:
    r, s = job.recipe, job.recipe.slurm
    out = RunDir.at(job.workdir).logs / OUT_NAME
    lines = [f"--job-name=dspark-{r.name}", f"--nodes={topo.nodes}", "--ntasks-per-node=1",
             f"--output={out}", "--open-mode=append",
             "--no-requeue"]  # a lost node ends the job, named; resubmitting resumes from the run folder
    for flag, value in (("partition", s.partition), ("account", s.account), ("qos", s.qos),
                        ("time", s.time_limit), ("gpus-per-node", s.gpus_per_node),
                        ("cpus-per-task", s.cpus_per_task), ("mem", s.mem)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    if s.exclusive:
        lines.append("--exclusive")
    lines += list(s.sbatch_args)
    return [f"#SBATCH {x}" for x in lines]


PREAMBLE = r'''set -euo pipefail
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER="${NODES[0]}"  # node 0: train.master_addr, the rendezvous host
BACKGROUND=()
stop_background() {  # the servers this job started, when it ends for any reason
  for pid in "${BACKGROUND[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${BACKGROUND[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_background EXIT
wait_url() {  # FILE PID TIMEOUT WHAT: the URL a `dspark-kit serve` step prints once its server is healthy
  local deadline=$((SECONDS + $3))
  until [ -s "$1" ]; do
    if ! kill -0 "$2" 2>/dev/null; then echo "error: $4 exited before it was healthy; see $LOGS" >&2; exit 1; fi
    if [ "$SECONDS" -ge "$deadline" ]; then echo "error: $4 not healthy within $3 s; see $LOGS" >&2; exit 1; fi
    sleep 1
  done
  head -n 1 "$1"
}'''


def _q(x: str) -> str:
    return shlex.quote(x)


def _kit(*words: str) -> str:
    return " ".join(['"$KIT" -m dspark_kit', *words, '-r "$RECIPE" -w "$WORKDIR" "${SETS[@]}"'])


def _on(nodes: str, n: int, *extra: str) -> str:
    # --overlap: a server step and the step that uses it share a node's allocation (else the second waits)
    return " ".join(["srun", "--overlap", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
                     f'--nodelist="{nodes}"', "--kill-on-bad-exit=1", *extra])


def _trainer_nodes(n: int) -> str:
    return ",".join(f"${{NODES[{i}]}}" for i in range(n))


def _spread_step(stage: str, topo: Topology, placement: list[str]) -> list[str]:
    """Every trainer node runs the stage command as node $SLURM_NODEID (each records the stage as
    that command does; where a node runs never enters the fingerprint, so the records agree)."""
    n = topo.trainer_nodes
    per_node = 'exec "$KIT" -m dspark_kit "$@" --set train.node_rank="$SLURM_NODEID"'
    args = [stage, '-r "$RECIPE" -w "$WORKDIR" "${SETS[@]}"', '--set train.master_addr="$MASTER"', *placement]
    return [f"# {stage} on {n} node(s) ({_trainer_nodes(n)}): each resolves its own interface and torchrun line",
            " ".join([_on(_trainer_nodes(n), n), "bash -c", _q(per_node), stage, *args])]


def _extractor_step(r: Recipe, topo: Topology) -> tuple[list[str], list[str]]:
    """The extraction server on its own node, its health wait, and the placement the trainers get."""
    node = f"${{NODES[{topo.trainer_nodes}]}}"
    url_file = '"$LOGS/slurm-$SLURM_JOB_ID-hidden-states.url"'
    what = "Mooncake master, then the hidden-state server" if topo.mooncake else "hidden-state server"
    sets = [f'--set serve.host="{node}"']
    placement = ['--set hidden_states.endpoint="$HS_URL"']
    if topo.mooncake:
        sets.append(f'--set hidden_states.mooncake.master_host="{node}"')
        placement.append(f'--set hidden_states.mooncake.master_host="{node}"')
    lines = [f"# {what} on node {topo.trainer_nodes} ({node}), started first; trainers wait for its URL (healthy)",
             " ".join([_on(node, 1), _kit("serve --role hidden-states"), *sets, f"> {url_file} &"]),
             "BACKGROUND+=($!)",
             f'HS_URL="$(wait_url {url_file} "$!" {r.serve.startup_timeout:g} "the hidden-state server on {node}")"',
             'echo "hidden-state server healthy at $HS_URL"']
    return lines, placement


STEP_MARK = "dspark-kit step: "  # a line before each step in the job's output: a failure is read after the last


def step_mark(what: str) -> str:
    return f'echo "{STEP_MARK}{what}"'


def regen_servers(recipe: Recipe, topo: Topology) -> bool:
    """regen with no regen.endpoints on an allocation of several nodes: a chat server on every node."""
    return recipe.regen.enabled and not recipe.regen.endpoints and topo.nodes > 1


def _regen_step(r: Recipe, topo: Topology) -> list[str]:
    """A chat server on every node, their health waits, regen on node 0 over all of them, then the
    servers stop (the devices are the next stage's)."""
    n = topo.nodes
    lines = [(f"# regen: a chat server on each of the {n} nodes, started together; regen on node 0 shares the rows "
              "over them once each printed its URL (healthy)"), "CHAT=()"]
    for i in range(n):
        node = f"${{NODES[{i}]}}"
        lines += [" ".join([_on(node, 1), _kit("serve --role chat"), f'--set serve.host="{node}"',
                            f'> "$LOGS/slurm-$SLURM_JOB_ID-chat-{i}.url" &']),
                  "CHAT+=($!)", "BACKGROUND+=($!)"]
    # one assignment each: under `set -e` a failed wait ends the job (an array of several would not)
    lines += [f'URL{i}="$(wait_url "$LOGS/slurm-$SLURM_JOB_ID-chat-{i}.url" "${{CHAT[{i}]}}" '
              f'{r.serve.startup_timeout:g} "the chat server on ${{NODES[{i}]}}")"' for i in range(n)]
    lines += ["URLS=(" + " ".join(f'"$URL{i}"' for i in range(n)) + ")",
              'ENDPOINTS="$(printf \'"%s",\' "${URLS[@]}")"',
              'echo "chat servers healthy at ${URLS[*]}"',
              " ".join([_on("${NODES[0]}", 1), _kit("run --stages regen"), '--set "regen.endpoints=[${ENDPOINTS%,}]"']),
              'for pid in "${CHAT[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done']
    return lines


def steps(job: SlurmJob, topo: Topology) -> list[str]:
    """The job's steps in start-up order: node-0 stages grouped, spread stages on every trainer node."""
    r, out, group = job.recipe, [], []

    def flush() -> None:
        if group:
            out.extend([f"# {', '.join(group)} on node 0 (${{NODES[0]}})", step_mark(",".join(group)),
                        " ".join([_on("${NODES[0]}", 1), _kit("run --stages", ",".join(group))])])
            group.clear()

    for stage in job.stages:
        if stage == "regen" and regen_servers(r, topo):
            flush()
            out += [step_mark("regen"), *_regen_step(r, topo)]
            continue
        if not spread(r, stage):
            group.append(stage)
            continue
        flush()
        placement: list[str] = []
        if stage == "train" and topo.extractor_nodes:
            server, placement = _extractor_step(r, topo)
            out += [step_mark("hidden-state server"), *server]
        elif stage == "train" and r.hidden_states.mode == "online" and not r.hidden_states.endpoint:
            out.append("# online hidden states: each trainer node's `train` starts its own extraction server "
                       "(slurm.extractor_nodes 1: one node of its own)")
        out += [step_mark(stage), *_spread_step(stage, topo, placement)]
    flush()
    return out


def batch_script(job: SlurmJob) -> str:
    """The whole script, as submitted (and as `--dry-run` prints it)."""
    topo = topology(job.recipe)
    trainers = f"{topo.trainer_nodes} trainer node(s)"
    extractor = f", {topo.extractor_nodes} extraction node" if topo.extractor_nodes else ""
    head = [
        "#!/bin/bash",
        f"# dspark-kit {job.command} under Slurm: recipe {job.recipe.name}, {topo.nodes} node(s): {trainers}{extractor}",
        f"# stages: {', '.join(job.stages) or 'none'}" + (f" (not run: {'; '.join(job.skipped)})" if job.skipped else ""),
        f"# written by `dspark-kit {job.command} --launcher slurm` (its --dry-run prints this file as submitted)",
        *sbatch_lines(job, topo),
        "",
        PREAMBLE,
        f"export KIT={_q(job.python)}  # the kit that wrote this job: the same install on every node (shared storage)",
        f"RECIPE={_q(str(job.recipe_path))}",
        f"WORKDIR={_q(str(job.workdir))}",
        'LOGS="$WORKDIR/logs"',
        "SETS=(" + " ".join(f"--set {_q(s)}" for s in job.sets) + ")",
        *job.recipe.slurm.setup,
        'echo "dspark-kit job $SLURM_JOB_ID on ${NODES[*]}"',
        "",
        *steps(job, topo),
        'echo "dspark-kit job $SLURM_JOB_ID done"',
    ]
    return "\n".join(head) + "\n"
