"""Offline hidden states through an extraction server (vLLM, vLLM-Ascend or our local engine).

The work itself is speculators' own `generate-offline-data`; we start the
server from the recipe, build its exact command, and shard it over nodes with
`--world-size/--rank` (one command per node in dry runs).
"""

from __future__ import annotations

import re
import sys
import time
from typing import TYPE_CHECKING

from dspark_kit.engines import openai_base_url
from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.resolved import Resolved
from dspark_kit.rundir import hidden_state_file, hidden_state_rows
from dspark_kit.specdec.hidden_state_files import FP8

if TYPE_CHECKING:
    from dspark_kit.stages.plan import Process, StagePlan


def speculators_validates(res: Resolved) -> bool:
    """generate-offline-data --validate-outputs: not for fp8 files. Its check_hidden_states
    (speculators/data_generation/offline.py:29) takes torch.aminmax of the raw tensor, which
    torch has no float8_e4m3fn kernel for ("aminmax_cpu" not implemented), so every fp8 row
    would fail; the kit checks those files itself, dequantized (`check_written`)."""
    return res.hidden_states_out_dtype.value != FP8


def offline_command(res: Resolved, endpoint: str, world_size: int = 1, rank: int = 0) -> list[str]:
    # generate-offline-data refuses a server whose first /v1/models id is not --model
    from dspark_kit.compat.versions import speculators_reads

    recipe = res.recipe
    return [
        sys.executable, "-m", "speculators", "generate-offline-data",
        "--model", res.served_names("hidden-states")[0],
        "--endpoint", openai_base_url(endpoint),
        "--preprocessed-data", str(res.run.prepared),
        "--concurrency", str(recipe.regen.concurrency),
        *(["--validate-outputs"] if speculators_validates(res) else []),
        "--world-size", str(world_size),
        "--rank", str(rank),
        # a row that fails stops the run (the kit names it) instead of being skipped
        *(["--fail-on-error"] if speculators_reads("generate-offline-data", "--fail-on-error") else []),
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


def offline_processes(res: Resolved) -> tuple[list[str], list[Process]]:
    """The extraction server (unless hidden_states.endpoint) and generate-offline-data, one per node
    (train.nnodes): the dry run's lines, and the processes this node's run starts."""
    from dspark_kit.engines import LaunchPlan
    from dspark_kit.stages.plan import Process
    from dspark_kit.stages.server_plan import server_plan

    recipe = res.recipe
    hs, n = recipe.hidden_states, recipe.train.nnodes
    server = None if hs.endpoint else server_plan(res, "hidden-states")
    url = hs.endpoint or server.base_url
    lines = node_notes(res)
    processes = [Process("hidden-state server", server)] if server else []
    start = ["# extraction server (on every node)", server.shell_line()] if server else []
    if hs.mode == "online":
        lines += res.mooncake.node_lines() if res.mooncake is not None else []
        lines.append("# online: no files are written ahead; each trainer asks "
                     f"{url} during training (`dspark-kit train --dry-run` prints the trainer command)")
        return lines + start, []
    lines += start
    for rank in range(n):
        # speculators logs through rich, which wraps at 80 columns in a pipe: wide enough that the
        # line naming a failed row stays whole
        launch = LaunchPlan(offline_command(res, url, world_size=n, rank=rank), {"COLUMNS": "240"})
        processes.append(Process("generate-offline-data", launch, node=rank))
        lines += [f"# node {rank} of {n}: shard {rank}/{n} of the rows into {res.run.hidden_states}",
                  launch.shell_line()]
    return lines, processes


# generate-offline-data's own line when a row fails under --fail-on-error
_FATAL = re.compile(r"Fatal: sample (\d+) aborted with --fail-on-error: (.*)")


def missing_rows(res: Resolved, world_size: int, rank: int) -> list[int]:
    """Rows of this node's shard without a hidden-state file (speculators' own sharding). On one
    node the shard is every row: no import of speculators (10 s and more of the stage's time)."""
    import json

    have = hidden_state_rows(res.run.hidden_states)
    try:  # prepare counted the rows it wrote
        n = int(json.loads((res.run.prepared / "prepare_meta.json").read_text())["summary"]["rows_out"])
    except (OSError, ValueError, KeyError, TypeError):
        from datasets import load_from_disk

        n = len(load_from_disk(str(res.run.prepared)))
    if world_size == 1:
        return [i for i in range(n) if i not in have]
    from speculators.data_generation.offline import get_indices_to_process

    return get_indices_to_process(n, None, sorted(have), world_size, rank)


def check_written(res: Resolved, rows: list[int], url: str) -> None:
    """What --validate-outputs checks, for the files of `rows` this run wrote without it (fp8):
    each opens, holds the row's token ids and finite states once dequantized; a bad one is
    removed (a rerun writes it again) and named."""
    if not rows:
        return
    from datasets import load_from_disk

    from dspark_kit.specdec.hidden_state_files import is_valid_file

    data = load_from_disk(str(res.run.prepared)).with_format(None)
    dtype = res.hidden_states_out_dtype.value
    for i in rows:
        path = hidden_state_file(res.run.hidden_states, i)
        if not is_valid_file(path, list(data[i]["input_ids"]), dtype):
            path.unlink(missing_ok=True)
            raise RuntimeError(f"row {i} of {res.run.prepared} from {url}: its hidden-state file is not a valid "
                               f"{dtype} file for the row (removed; rerun to write it again)")


def run_offline_vllm(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    """speculators generate-offline-data (this node's, from the stage plan) against the extraction
    server; a row that fails stops it (--fail-on-error) and the error names the row, never a file
    silently left out."""
    import os

    from dspark_kit import processes
    from dspark_kit.logs import failed_row, log_since
    from dspark_kit.stages.server_plan import hidden_state_server

    recipe, t0 = res.recipe, time.time()
    world, rank = recipe.train.nnodes, recipe.train.node_rank
    todo = [] if speculators_validates(res) else missing_rows(res, world, rank)
    log = res.run.offline_data_log
    since = log.stat().st_size if log.exists() else 0
    server = plan.process("hidden-state server")
    job = next(p.launch for p in plan.processes if p.role == "generate-offline-data" and p.node == rank)
    argv = job.argv
    with hidden_state_server(res, server.server if server else None) as endpoint:
        code, gone = processes.run_logged(job.argv, {**os.environ, **job.env}, log, watch=endpoint.gone,
                                          echo=reporter.echo_children)
    if gone:
        raise RuntimeError(f"{gone}; rerun to resume (written files are kept)")
    if code != 0:
        row = failed_row(log_since(log, since), _FATAL)
        if row is not None:  # --validate-outputs moved a bad file into place before it failed: never keep it
            hidden_state_file(res.run.hidden_states, row[0]).unlink(missing_ok=True)
            raise RuntimeError(f"row {row[0]} of {res.run.prepared} from {endpoint.url} failed: "
                               f"{row[1]}; see {log}")
        raise RuntimeError(f"speculators generate-offline-data exited with {code}; see {log}")
    missing = missing_rows(res, world, rank)
    if missing:
        raise RuntimeError(f"no file for rows {missing[:10]}{' ...' if len(missing) > 10 else ''} "
                           f"of {res.run.prepared} after generate-offline-data; see {log}")
    check_written(res, todo, endpoint.url)
    files = len(hidden_state_rows(res.run.hidden_states))
    return {"generated": files, "seconds": round(time.time() - t0, 1), "argv": argv}
