"""Submit the batch script, follow the job, cancel it, and say how it ended.

`make_job` decides what the script holds (the stages the run folder's state leaves to run, via
`stages.pipeline.stage_decisions`); `submit` writes it to the run folder (temp, then rename) and
hands it to `sbatch`; `follow` watches the job's state (`squeue`, then `scontrol show job` /
`sacct` for its end) and relays the job's own output (DIR/logs/slurm-<id>.out: the kit's stage
lines, with their progress) until it ends; on Ctrl-C the caller calls `cancel` (`scancel`).
`ending` turns the end into the exit code (the job's) and one line; a failed job is named by the
node whose task failed (srun's own "srun: error: NODE: task N: ..." line, or the node Slurm lost).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dspark_kit import atomic
from dspark_kit.launchers.slurm_script import (
    SCRIPT_NAME,
    STEP_MARK,
    SlurmJob,
    batch_script,
    job_out,
)
from dspark_kit.processes import signal_exit_code
from dspark_kit.recipe import Recipe
from dspark_kit.rundir import RunDir

CLIENT_TIMEOUT_S = 60
RELAY_PREFIX = "  | "  # before each line the job writes, as the command relays it


class SlurmError(RuntimeError):
    """A Slurm client failed or is missing; the message says which and why, in one line."""


def make_job(recipe: Recipe, recipe_path: Path, workdir: Path, sets: list[str] | None, command: str,
             stages: list[str] | None = None, start: str | None = None, force: bool = False) -> SlurmJob:
    """The job for `command` (run: the selected stages the run folder's state leaves to run, as a local
    `run` would decide; a stage command: that stage)."""
    from dspark_kit.stages.pipeline import load_state, stage_decisions

    skipped: list[str] = []
    if command == "run":
        decided = stage_decisions(recipe, load_state(workdir), stages, start, force)
        todo = tuple(name for name, what, _ in decided if what == "run")
        skipped = [f"{name} {what}" for name, what, _ in decided if what != "run"]
    else:
        todo = (command,)
    return SlurmJob(recipe, recipe_path.resolve(), workdir.resolve(), tuple(sets or ()), todo,
                    sys.executable, command, tuple(skipped))


def _client(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} not found: --launcher slurm runs on a machine with the Slurm clients "
                         "(sbatch, squeue, scancel) on PATH, e.g. the cluster's login node") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)} did not answer within {CLIENT_TIMEOUT_S} s: is slurmctld up?") from None
    if check and proc.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip() or proc.returncode}")
    return proc


def submit(job: SlurmJob) -> tuple[str, Path]:
    """Write the script to DIR/slurm-job.sbatch and sbatch it; returns (job id, the job's output file)."""
    run = RunDir.at(job.workdir)
    run.logs.mkdir(parents=True, exist_ok=True)
    script = job.workdir / SCRIPT_NAME
    atomic.write_text(script, batch_script(job))
    proc = _client(["sbatch", "--parsable", f"--chdir={os.getcwd()}", str(script)])
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
    return job_id, job_out(run.logs, job_id)


@dataclass
class JobEnd:
    job_id: str
    state: str  # COMPLETED, FAILED, CANCELLED, NODE_FAIL, TIMEOUT, OUT_OF_MEMORY, ...
    exit_code: int  # the job's: its script's exit status (128 + signal when killed)
    nodes: str  # the job's node list
    reason: str = ""


_END_STATES = ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "PREEMPTED",
               "BOOT_FAIL", "DEADLINE")


def _exit_code(value: str) -> int:
    """Slurm's "code:signal" as one exit status."""
    code, _, sig = value.partition(":")
    try:
        return int(code) if int(code) or not sig or not int(sig) else signal_exit_code(int(sig))
    except ValueError:
        return 1


def job_state(job_id: str) -> tuple[str, str, str, str]:
    """(state, exit code field, nodes, reason) of a job, from squeue while it is known there, else
    `scontrol show job`, else `sacct` (when accounting is kept)."""
    q = _client(["squeue", "-h", "-j", job_id, "-o", "%T|%N|%r"], check=False)
    if q.returncode == 0 and q.stdout.strip():
        state, nodes, reason = (q.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
        if state not in _END_STATES:
            return state, "", nodes, reason
    c = _client(["scontrol", "show", "job", "-o", job_id], check=False)
    if c.returncode == 0 and "JobState=" in c.stdout:
        f = dict(re.findall(r"(\w+)=(\S*)", c.stdout))
        return f.get("JobState", "UNKNOWN"), f.get("ExitCode", ""), f.get("NodeList", ""), f.get("Reason", "")
    a = _client(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,NodeList"], check=False)
    if a.returncode == 0 and a.stdout.strip():
        state, code, nodes = (a.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
        return state.split()[0], code, nodes, ""
    return "UNKNOWN", "", "", (c.stderr or a.stderr).strip()


class OutputTail:
    """New whole lines of the job's output file since the last look."""

    def __init__(self, path: Path):
        self.path, self.pos, self.rest = path, 0, ""

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        text = self.rest + data.decode("utf-8", "replace")
        *whole, self.rest = text.split("\n")
        return whole


def follow(job_id: str, out: Path, echo: Callable[[str], None], poll_s: float = 2.0,
           sleep: Callable[[float], None] = time.sleep) -> JobEnd:
    """Watch job `job_id` until it ends: each state change is one line, each line the job writes is
    relayed after RELAY_PREFIX (the stage lines of the kit inside it); returns how it ended."""
    tail, shown = OutputTail(out), ""
    relay = RELAY_PREFIX  # the job's lines, indented: the command's own last line is its verdict
    while True:
        state, code, nodes, reason = job_state(job_id)
        for line in tail.lines():
            echo(relay + line)
        base = state.split()[0] if state else "UNKNOWN"
        if base != shown:
            where = f" on {nodes}" if nodes and base == "RUNNING" else (f" ({reason})" if reason and reason != "None"
                                                                        and base == "PENDING" else "")
            echo(f"slurm: job {job_id} {base}{where}")
            shown = base
        if base in _END_STATES:
            sleep(min(poll_s, 0.5))  # the output file's last lines land just after the job ends
            for line in tail.lines() + ([tail.rest] if tail.rest else []):
                echo(relay + line)
            return JobEnd(job_id, base, _exit_code(code) if code else (0 if base == "COMPLETED" else 1), nodes,
                          reason)
        sleep(poll_s)


def cancel(job_id: str) -> None:
    _client(["scancel", job_id])


_TASK_FAILED = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (.+)")
_NODE_LOST = re.compile(r"srun: error: Node failure on (\S+)")


def ending(end: JobEnd, out: Path, again: str) -> tuple[int, str | None]:
    """(exit code, one line) for a job's end: None when it completed; else the node that failed and why,
    the first error the kit printed inside the job, where the log is, and the command that resumes."""
    if end.state == "COMPLETED" and end.exit_code == 0:
        return 0, None
    text = out.read_text(errors="replace") if out.exists() else ""
    lines = text.splitlines()
    marks = [i for i, ln in enumerate(lines) if ln.startswith(STEP_MARK)]
    step = lines[marks[-1]].removeprefix(STEP_MARK) if marks else None
    last = "\n".join(lines[marks[-1]:]) if marks else text  # the step that failed (set -e: the last started)
    failed = _TASK_FAILED.findall(last)  # (servers stopped after an earlier step are not the failure)
    kit_error = next((ln.strip() for ln in last.splitlines() if ln.startswith("error: ")), None)
    if end.state == "NODE_FAIL":  # srun names the node it lost; else the job's nodes
        lost = _NODE_LOST.findall(last)
        why = f", Slurm: {end.reason}" if end.reason not in ("", "None") else ""
        where = f": node {lost[0] if lost else end.nodes} was lost (it stopped answering{why})"
    elif failed:
        node, task, why = failed[0]
        where = f" on node {node} (task {task}: {why.strip().rstrip('.')})"
    else:
        where = ""
    said = f": {kit_error.removeprefix('error: ')}" if kit_error else ""
    code = end.exit_code or 1
    in_step = f" in step {step}" if step and end.state != "CANCELLED" else ""
    verb = "failed" if end.state in ("FAILED", "NODE_FAIL") else end.state.lower().replace("_", " ")
    return code, (f"Slurm job {end.job_id} {verb}{in_step}{where}{said}; see {out}; "
                  f"`{again}` resubmits it and resumes from the run folder's state")


def launch_job(job: SlurmJob, echo: Callable[[str], None], again: str) -> tuple[int, str | None]:
    """Submit, follow to the end; Ctrl-C cancels the job (scancel). Returns (exit code, one line or None)."""
    job_id, out = submit(job)
    echo(f"slurm: submitted job {job_id}: {job.workdir / SCRIPT_NAME} ({', '.join(job.stages)}); output {out}")
    try:
        end = follow(job_id, out, echo, job.recipe.slurm.poll_s)
    except KeyboardInterrupt:
        cancel(job_id)
        return 130, (f"interrupted: cancelled Slurm job {job_id} (scancel); `{again}` resubmits it and resumes "
                     "from the run folder's state")
    return ending(end, out, again)
