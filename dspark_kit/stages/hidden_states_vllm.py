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


def dry_run_lines(recipe: Recipe, workdir: Path) -> list[str]:
    """The extraction server and one generate-offline-data command per node (train.nnodes)."""
    from dspark_kit.engines.servers import server_plan

    res = Resolved(recipe, workdir, planning=True)
    plan = server_plan(res, "hidden-states", port=recipe.serve.hidden_states_port)
    url = recipe.hidden_states.endpoint or plan.base_url
    n = recipe.train.nnodes
    lines = [] if recipe.hidden_states.endpoint else ["# extraction server (on every node)", plan.shell_line()]
    for rank in range(n):
        lines += [f"# node {rank} of {n}",
                  shlex.join(offline_command(res, url, world_size=n, rank=rank))]
    return lines


def run_offline_vllm(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.engines.servers import hidden_state_server

    t0 = time.time()
    res = Resolved(recipe, workdir)
    with hidden_state_server(res) as url:
        argv = offline_command(res, url, recipe.train.nnodes, recipe.train.node_rank)
        code = subprocess.run(argv, check=False).returncode
    if code != 0:
        raise RuntimeError(f"speculators generate-offline-data exited with {code}")
    files = len(list(res.run.hidden_states.glob("hs_*.safetensors")))
    return {"generated": files, "seconds": round(time.time() - t0, 1), "argv": argv}
