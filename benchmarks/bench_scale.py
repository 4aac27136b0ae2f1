"""Cost as the work grows: prepare, regen and hidden states at three sizes spanning 100x.

    .venv/bin/python benchmarks/bench_scale.py [--prepare 1000,10000,100000] [--regen 1000,10000,100000]
        [--hidden 20,200,2000] [--plot docs/scale.png] [--json out.json]

Each size runs in its own child process (`--child STAGE`), so its peak RSS is its own
(VmHWM of the child: the peak of its memory since it started). The child first runs the stage once on a few rows
(imports, tokenizer and model files warm), then times the real run: the stage function
itself on a jsonl / prepared dir written beforehand, so the child never holds the input
either. A size whose run is short repeats it until the runs add up to 3 s and reports the
median run. Regen talks to a zero-latency stub in a process of its own (not counted).

Hidden states run with one torch thread (see child_hidden). Goals: wall time per row at the largest size at most 1.3x the smallest (the cost grows no
faster than the work) and peak RSS at the largest at most 1.5x the middle one (rows are
streamed, never all held). CPU seconds per row are shown too: on a shared machine wall
time moves with the load, CPU time much less.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, cli, emit, this_command

TIME_GOAL, RSS_GOAL = 1.3, 1.5
WARMUP_ROWS = 64
MIN_SECONDS = 3.0  # a size's timed runs repeat until they add up to this


# ---- children: one stage at one size ------------------------------------------------


def _timed(fn, before=lambda: None) -> dict:
    """Run fn (-> rows done) until MIN_SECONDS have passed (at least once), `before` ahead of each
    run; the median run's figures. A small size repeats, so a load spike does not decide it."""
    runs = []
    while not runs or sum(r["seconds"] for r in runs) < MIN_SECONDS:
        before()
        t0, c0 = time.perf_counter(), time.process_time()
        n = fn()
        runs.append({"rows": n, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0})
    runs.sort(key=lambda r: r["seconds"])
    return {**runs[len(runs) // 2], "runs": len(runs)}


def child_prepare(src: Path, work: Path, warm: Path) -> dict:
    from dspark_kit.data.tiny_verifier import ensure_tiny_verifier
    from dspark_kit.stages.dataset.prepare import prepare, read_jsonl

    vp = str(ensure_tiny_verifier())
    quiet = {"seq_length": 256, "thinking": False, "num_workers": 1}
    prepare(read_jsonl(warm), vp, work / "warm", **quiet)
    return _timed(lambda: prepare(read_jsonl(src), vp, work / "prepared", **quiet).conversations_in)


def child_regen(src: Path, work: Path, warm: Path, url: str) -> dict:
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.dataset.regen import run_regen

    recipe = load_recipe(REPO / "recipes" / "tiny-cpu.yaml")
    recipe.data.limit = None
    recipe.regen.concurrency, recipe.regen.max_tokens = 64, 8

    def run(path: Path, out: Path) -> int:
        recipe.data.source = str(path)
        return run_regen(Resolved(recipe, work), out, endpoints=[url], resume=False, overwrite=True)["written"]

    run(warm, work / "warm.jsonl")
    return _timed(lambda: run(src, work / "regen.jsonl"))


def child_hidden(prepared: Path, work: Path, warm: Path) -> dict:
    import torch

    from dspark_kit.data.tiny_verifier import ensure_tiny_verifier
    from dspark_kit.stages.hidden.hidden_states import generate_offline

    # one thread: on 2 shared cores torch's two threads wait on each other whenever another
    # process holds a core (a tiny forward then takes 40-250 ms instead of 3-5 ms, measured),
    # and that noise would swamp the growth this measures
    torch.set_num_threads(1)
    vp = str(ensure_tiny_verifier())
    generate_offline(warm, vp, [1, 2, 3], log=lambda _m: None)
    return _timed(lambda: generate_offline(prepared, vp, [1, 2, 3], log=lambda _m: None).generated,
                  before=lambda: shutil.rmtree(prepared / "hidden_states", ignore_errors=True))


def peak_rss_mib() -> float:
    """This process's own peak RSS since it started. Not ru_maxrss: the kernel carries the
    parent's high-water mark over fork + exec into it, so a child started by a 500 MiB parent
    would report at least 500 MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)


def child_main(argv: list[str]) -> None:
    stage, paths, rest = argv[0], [Path(a) for a in argv[1:4]], argv[4:]
    out = {"prepare": child_prepare, "regen": child_regen, "hidden": child_hidden}[stage](*paths, *rest)
    print(json.dumps({**out, "peak_rss_mib": peak_rss_mib()}))


# ---- parent: inputs, children, figures ------------------------------------------------


def write_rows(path: Path, n: int, seed: int) -> Path:
    from dspark_kit.data.tiny_corpus import conversations

    with path.open("w") as f:
        for m in conversations(n, seed=seed, max_turns=1):
            f.write(json.dumps({"messages": m}) + "\n")
    return path


def run_child(argv: list[str], timeout: int) -> dict:
    """The child's figures: rows, seconds, CPU seconds of the timed run, its own peak RSS (MiB)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *map(str, argv)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{argv[0]} timed out after {timeout}s") from None
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{argv[0]} failed (exit {proc.returncode}): {tail[0][:200]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def serve_stub(port: int) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_regen_client import serve_stub as serve

    serve(port)


def stage_rows(name: str, results: list[dict], unit: str) -> list[Row]:
    small, mid, large = results
    per = [r["seconds"] / r["rows"] for r in results]
    cpu = [r["cpu_seconds"] / r["rows"] for r in results]
    out = [Row(f"scale: {name}", f"{r['rows']:,} {unit}", per[i] * 1e3, "ms/row",
               notes=f"{r['seconds']:.2f} s wall (median of {r['runs']} run(s)), {cpu[i] * 1e3:.3f} ms CPU/row, "
                     f"peak RSS {r['peak_rss_mib']:.0f} MiB")
           for i, r in enumerate(results)]
    t_ratio, rss_ratio = per[2] / per[0], large["peak_rss_mib"] / mid["peak_rss_mib"]
    out.append(Row(f"scale: {name}", f"time per row, {large['rows']:,} / {small['rows']:,} {unit}", t_ratio, "x",
                   f"<= {TIME_GOAL}x", t_ratio <= TIME_GOAL, notes=f"CPU per row {cpu[2] / cpu[0]:.2f}x"))
    out.append(Row(f"scale: {name}", f"peak RSS, {large['rows']:,} / {mid['rows']:,} {unit}", rss_ratio, "x",
                   f"<= {RSS_GOAL}x", rss_ratio <= RSS_GOAL,
                   notes=f"{large['peak_rss_mib']:.0f} vs {mid['peak_rss_mib']:.0f} MiB"))
    return out


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, res in curves.items():
        rows = [r["rows"] for r in res]
        a.plot(rows, [r["seconds"] / r["rows"] * 1e3 for r in res], "o-", label=name)
        b.plot(rows, [r["peak_rss_mib"] for r in res], "o-", label=name)
    for ax, title in ((a, "wall time per row (ms)"), (b, "peak RSS (MiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("rows")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    a.set_yscale("log")
    fig.suptitle("Cost as the work grows (each size its own process; benchmarks/bench_scale.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def sizes(text: str) -> list[int]:
    out = [int(x) for x in text.split(",")]
    if len(out) != 3:
        raise SystemExit("three sizes, e.g. 1000,10000,100000")
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child_main(sys.argv[2:])
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--prepare", type=sizes, default=[1000, 10000, 100000])
    ap.add_argument("--regen", type=sizes, default=[1000, 10000, 100000])
    ap.add_argument("--hidden", type=sizes, default=[20, 200, 2000])
    ap.add_argument("--plot", type=Path, help="write the time and memory curves here (PNG)")
    ap.add_argument("--timeout", type=int, default=600, help="per child, seconds")
    args = ap.parse_args()
    from dspark_kit.engines.ports import free_port

    rows: list[Row] = []
    curves: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as d:
        d = Path(d)
        warm = write_rows(d / "warm.jsonl", WARMUP_ROWS, seed=99)
        inputs = {n: write_rows(d / f"rows-{n}.jsonl", n, seed=7) for n in sorted({*args.prepare, *args.regen})}

        def measure(name: str, unit: str, argvs: list[list]) -> None:
            try:
                res = []
                for argv in argvs:
                    res.append(run_child(argv, args.timeout))
                    print(f"{name}: {res[-1]}", file=sys.stderr, flush=True)
                curves[name] = res
                rows.extend(stage_rows(name, res, unit))
            except Exception as e:  # noqa: BLE001 - a failed stage is a row saying so, not a lost report
                rows.append(Row(f"scale: {name}", "not measured", None, notes=f"{type(e).__name__}: {e}"[:300]))

        measure("prepare", "conversations",
                [["prepare", inputs[n], d / f"p{n}", warm] for n in args.prepare])

        port = free_port()
        stub = mp.get_context("spawn").Process(target=serve_stub, args=(port,), daemon=True)
        stub.start()
        try:
            url = f"http://127.0.0.1:{port}/v1"
            wait_for(url)
            measure("regen", "conversations", [["regen", inputs[n], d / f"r{n}", warm, url] for n in args.regen])
        finally:
            stub.terminate()
            stub.join(10)

        prepared = prepare_for_hidden(d, {**{n: n for n in args.hidden}, "warm": WARMUP_ROWS // 8})
        measure("hidden states", "rows", [["hidden", prepared[n], d / f"h{n}", prepared["warm"]]
                                          for n in args.hidden])
    if args.plot and curves:
        plot(curves, args.plot)
    spans = ", ".join(f"{k} {v[0]['rows']:,}-{v[-1]['rows']:,}" for k, v in curves.items())
    emit(rows, args.json, this_command("bench_scale.py", " ".join(
        [f"--prepare {','.join(map(str, args.prepare))}", f"--regen {','.join(map(str, args.regen))}",
         f"--hidden {','.join(map(str, args.hidden))}"])))
    print(f"sizes: {spans}", file=sys.stderr)


def wait_for(url: str) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/models")
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("the regen stub did not start")


def prepare_for_hidden(d: Path, counts: dict) -> dict:
    """A prepared dataset of exactly n rows per name (1-turn chats: one row each)."""
    from datasets import load_from_disk

    from dspark_kit.data.tiny_verifier import ensure_tiny_verifier
    from dspark_kit.stages.dataset.prepare import prepare, read_jsonl

    vp, out = str(ensure_tiny_verifier()), {}
    for name, n in counts.items():
        src = write_rows(d / f"hs-rows-{name}.jsonl", n, seed=11)
        out[name] = d / f"hs-prepared-{name}"
        prepare(read_jsonl(src), vp, out[name], seq_length=256, thinking=False)
        assert len(load_from_disk(str(out[name]))) == n
    return out


if __name__ == "__main__":
    main()
