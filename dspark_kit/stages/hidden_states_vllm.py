"""Offline hidden states through an extraction server (vLLM, vLLM-Ascend or our local engine).

The work itself is speculators' own `generate-offline-data`; we start the
server from the recipe, build its exact command, and shard it over nodes with
`--world-size/--rank` (one command per node in dry runs).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time

from dspark_kit.engines import openai_base_url
from dspark_kit.resolved import Resolved


def offline_command(res: Resolved, endpoint: str, world_size: int = 1, rank: int = 0) -> list[str]:
    # the served model id must be the verifier path the trainer will use
    recipe = res.recipe
    return [
        sys.executable, "-m", "speculators", "generate-offline-data",
        "--model", res.served_name,
        "--endpoint", openai_base_url(endpoint),
        "--preprocessed-data", str(res.run.prepared),
        "--concurrency", str(recipe.regen.concurrency),
        "--validate-outputs",
        "--world-size", str(world_size),
        "--rank", str(rank),
    ]


def node_notes(res: Resolved) -> list[str]:
    """What every node needs for hidden states across train.nnodes machines (comment lines)."""
    recipe, workdir = res.recipe, res.run.root
    hs, n = recipe.hidden_states, recipe.train.nnodes
    if n == 1:
        return []
    shared = "shared, as the recipe says" if hs.storage_shared else "must be shared storage, same path on every node"
    lines = [(f"# {n} nodes: run dir {workdir} must be shared storage mounted at the same path on every node "
              "(trainers read prepared/ from it; rank 0 writes checkpoints/ there and a restart resumes from them)")]
    if hs.endpoint:
        lines.append(f"# one extraction server for all {n} nodes at {hs.endpoint} (must be reachable from every "
                     f"node, not 127.0.0.1); it writes into hidden_states.storage_path {hs.storage_path}, which "
                     f"trainers on other nodes read by path: {shared} (hidden_states.storage_shared)")
    else:
        where = "`dspark-kit train` starts" if hs.mode == "online" else "start"
        lines.append(f"# one extraction server per node: on every node {where} the server below (serve.devices "
                     f"{recipe.serve.devices or 'default'} next to train.devices {recipe.train.devices or 'default'}); "
                     f"it writes and reads hidden_states.storage_path {hs.storage_path} on that node only")
    return lines


def dry_run_lines(res: Resolved) -> list[str]:
    """The extraction server and one generate-offline-data command per node (train.nnodes)."""
    from dspark_kit.engines.servers import server_plan

    recipe = res.recipe
    plan = server_plan(res, "hidden-states", port=recipe.serve.hidden_states_port)
    url = recipe.hidden_states.endpoint or plan.base_url
    n = recipe.train.nnodes
    lines = node_notes(res)
    if recipe.hidden_states.mode == "online":
        lines.append("# online: no files are written ahead; each trainer asks "
                     f"{url} during training (`dspark-kit train --dry-run` prints the trainer command)")
        return lines + ([] if recipe.hidden_states.endpoint else ["# extraction server (on every node)", plan.shell_line()])
    lines += [] if recipe.hidden_states.endpoint else ["# extraction server (on every node)", plan.shell_line()]
    for rank in range(n):
        lines += [f"# node {rank} of {n}: shard {rank}/{n} of the rows into {res.run.hidden_states}",
                  shlex.join(offline_command(res, url, world_size=n, rank=rank))]
    return lines


def run_offline_vllm(res: Resolved) -> dict:
    from dspark_kit.engines.servers import hidden_state_server

    recipe, t0 = res.recipe, time.time()
    with hidden_state_server(res) as url:
        argv = offline_command(res, url, recipe.train.nnodes, recipe.train.node_rank)
        from dspark_kit.engines.lifecycle import die_with_parent_preexec

        code = subprocess.run(argv, check=False, preexec_fn=die_with_parent_preexec()).returncode
    if code != 0:
        raise RuntimeError(f"speculators generate-offline-data exited with {code}")
    files = len(list(res.run.hidden_states.glob("hs_*.safetensors")))
    return {"generated": files, "seconds": round(time.time() - t0, 1), "argv": argv}
