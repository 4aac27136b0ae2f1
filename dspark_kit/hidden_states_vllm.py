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
from pathlib import Path

from dspark_kit.engines import openai_base_url
from dspark_kit.recipe import Recipe


def offline_command(recipe: Recipe, workdir: Path, endpoint: str, verifier: str,
                    world_size: int = 1, rank: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "speculators", "generate-offline-data",
        "--model", verifier,
        "--endpoint", openai_base_url(endpoint),
        "--preprocessed-data", str(Path(workdir) / "prepared"),
        "--concurrency", str(recipe.regen.concurrency),
        "--validate-outputs",
        "--world-size", str(world_size),
        "--rank", str(rank),
    ]


def node_notes(recipe: Recipe, workdir: Path) -> list[str]:
    """What every node needs for hidden states across train.nnodes machines (comment lines)."""
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


def dry_run_lines(recipe: Recipe, workdir: Path) -> list[str]:
    """The extraction server and one generate-offline-data command per node (train.nnodes)."""
    from dspark_kit.pipeline import verifier_path
    from dspark_kit.servers import server_plan

    plan = server_plan(recipe, "hidden-states", port=recipe.serve.hidden_states_port, workdir=workdir)
    url = recipe.hidden_states.endpoint or plan.base_url
    model = recipe.verifier.served_name or verifier_path(recipe)
    n = recipe.train.nnodes
    lines = node_notes(recipe, workdir)
    if recipe.hidden_states.mode == "online":
        lines.append("# online: no files are written ahead; each trainer asks "
                     f"{url} during training (`dspark-kit train --dry-run` prints the trainer command)")
        return lines + ([] if recipe.hidden_states.endpoint else ["# extraction server (on every node)", plan.shell_line()])
    lines += [] if recipe.hidden_states.endpoint else ["# extraction server (on every node)", plan.shell_line()]
    for rank in range(n):
        lines += [f"# node {rank} of {n}: shard {rank}/{n} of the rows into {Path(workdir) / 'prepared' / 'hidden_states'}",
                  shlex.join(offline_command(recipe, workdir, url, model, world_size=n, rank=rank))]
    return lines


def run_offline_vllm(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.pipeline import verifier_path
    from dspark_kit.servers import hidden_state_server

    t0 = time.time()
    with hidden_state_server(recipe, workdir) as url:
        # the served model id must be the verifier path the trainer will use
        argv = offline_command(recipe, workdir, url, recipe.verifier.served_name or verifier_path(recipe),
                               recipe.train.nnodes, recipe.train.node_rank)
        code = subprocess.run(argv, check=False).returncode
    if code != 0:
        raise RuntimeError(f"speculators generate-offline-data exited with {code}")
    files = len(list((Path(workdir) / "prepared" / "hidden_states").glob("hs_*.safetensors")))
    return {"generated": files, "seconds": round(time.time() - t0, 1), "argv": argv}
