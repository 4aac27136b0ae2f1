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


def dry_run_lines(recipe: Recipe, workdir: Path) -> list[str]:
    """The extraction server and one generate-offline-data command per node (train.nnodes)."""
    from dspark_kit.pipeline import verifier_path
    from dspark_kit.servers import server_plan

    plan = server_plan(recipe, "hidden-states", port=recipe.serve.hidden_states_port, workdir=workdir)
    url = recipe.hidden_states.endpoint or plan.base_url
    model = recipe.verifier.served_name or verifier_path(recipe)
    n = recipe.train.nnodes
    lines = [] if recipe.hidden_states.endpoint else ["# extraction server (on every node)", plan.shell_line()]
    for rank in range(n):
        lines += [f"# node {rank} of {n}",
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
        from dspark_kit.lifecycle import die_with_parent_preexec

        code = subprocess.run(argv, check=False,
                              preexec_fn=die_with_parent_preexec()).returncode
    if code != 0:
        raise RuntimeError(f"speculators generate-offline-data exited with {code}")
    files = len(list((Path(workdir) / "prepared" / "hidden_states").glob("hs_*.safetensors")))
    return {"generated": files, "seconds": round(time.time() - t0, 1), "argv": argv}
