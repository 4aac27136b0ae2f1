"""Training memory: the plan (dspark_kit/resolved/memory_plan.py) vs the measured peak of the tiny training.

    .venv/bin/python benchmarks/bench_memory.py [--seq-lengths 2048 8192 16384] [--anchors 256 1024]
        [--steps 3] [--rows 256] [--plot docs/memory_plan.png] [--points-json points.json] [--json out.json]

One prepared run (tiny recipe, offline hidden states, rows packed to each sequence length); then, for each
sequence length x max_anchors x gradient checkpointing off/on, `speculators train` (the kit's train entry,
train.max_steps steps, one epoch) in a fresh process. It records its anonymous RSS when the draft's first
forward starts (idle: imports, the fp32 model and the step's batch of hidden states are in memory) and
the peak of its anonymous RSS during each training step's forward and backward (sampled every
millisecond; file-backed pages are libtorch's code; validation and the checkpoint's save come after and
are reported apart) -- on CUDA, torch.cuda.max_memory_allocated over the same span. The plan's
training-time part (MemoryPlan.step_bytes: gradients, AdamW moments, activations, logits and the CPU
runtime term) is compared with peak - idle. The cost of checkpointing: val accept_len and the median
step time (after the first) of the same points with and without it. `--from-points` re-plans the
points an earlier run measured (after a change to the plan) without measuring again.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, cli, emit, this_command

GOAL = 0.20  # |plan - measured| / measured
# glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which freed
# tensors stay in its heap: a second step's RSS then reads ~25% above the first's (fragmentation, not
# tensors). Pinned, freed tensors go back to the OS and RSS follows the live tensors, as
# torch.cuda.max_memory_allocated does on CUDA.
PINNED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _anon() -> int:
    """Anonymous resident bytes (RSS less file-backed pages: code a first step touches in libtorch is
    not the step's memory)."""
    resident, shared = (int(x) for x in Path("/proc/self/statm").read_text().split()[1:3])
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")


class AnonPeak:
    """The highest anonymous RSS, sampled every millisecond by a thread (torch releases the GIL in its ops)."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _anon())

    def start(self) -> None:
        self.peak = _anon()
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _anon())


def probe(out: Path, argv: list[str]) -> None:
    """Run the kit's train entry in this process; write idle and peak memory to `out`."""
    import speculators.train.cli  # noqa: F401 - imports are the idle process, not the step
    import torch

    from dspark_kit.compat import train_entry

    cuda = "--dspark-device" in argv and argv[argv.index("--dspark-device") + 1] == "cuda"
    idle: dict[str, int] = {}

    def first_step(module, _inputs):  # the draft's first forward: model, optimizer and batch are in memory
        if type(module).__name__.endswith("DraftModel") and not idle:
            idle["rss"] = _anon()
            sampler.start()
            idle["cuda"] = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            handle.remove()

    sampler = AnonPeak()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(first_step)
    phases: list[tuple[str, int]] = []  # (forward|backward, peak over idle) per training step
    ends: list[float] = []  # when each backward returned: step times are their differences
    backward = torch.Tensor.backward

    def timed_backward(self, *a, **k):  # the forward's peak (loss included) apart from the backward's
        if not idle:
            return backward(self, *a, **k)
        phases.append(("forward", max(sampler.peak, _anon()) - idle["rss"]))
        sampler.peak = 0
        out = backward(self, *a, **k)
        ends.append(time.perf_counter())
        phases.append(("backward", max(sampler.peak, _anon()) - idle["rss"]))
        sampler.peak = 0
        return out

    torch.Tensor.backward = timed_backward
    t0 = time.perf_counter()
    train_entry.main(argv)
    rest = sampler.stop() - idle["rss"]  # after the last backward: validation, the checkpoint's save
    steps = max(v for _, v in phases)
    result = {"idle": idle["rss"], "peak": idle["rss"] + steps, "after_steps": rest, "vm_hwm": _status("VmHWM"), "phases": phases, "step_s": [b - a for a, b in itertools.pairwise(ends)], "wall_s": time.perf_counter() - t0}
    if cuda:
        result["cuda_step"] = torch.cuda.max_memory_allocated() - idle["cuda"]
    out.write_text(json.dumps(result))


def measure(res, wd: Path, steps: int) -> dict:
    from dspark_kit.stages.steps import REGISTRY
    from dspark_kit.stages.training.train import read_val_metrics

    launch = REGISTRY["train"].plan(res).process("trainer").launch
    argv = launch.argv[launch.argv.index("dspark_kit.compat.train_entry") + 1:]
    shutil.rmtree(wd / "checkpoints", ignore_errors=True)
    out = wd / "probe.json"
    cmd = ["nice", "-n", "10", sys.executable, str(Path(__file__).resolve()), "--probe", str(out), "--", *argv]
    log = wd / "logs" / "train.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as f:
        code = subprocess.run(cmd, env={**os.environ, **launch.env, **PINNED_MMAP}, stdout=f, stderr=subprocess.STDOUT,
                              check=False).returncode
    if code:
        raise RuntimeError(f"training failed ({code}): {log.read_text()[-2000:]}")
    m = json.loads(out.read_text())
    val = read_val_metrics(wd / "checkpoints") or {}
    m["accept_len"] = val.get("accept_len_epoch") or next((v for k, v in val.items() if "accept" in k), None)
    return m


def phases_mib(m: dict) -> str:
    return " ".join(f"{k[0]}{v / 2**20:.0f}" for k, v in m.get("phases", [])) + f" rest {m['after_steps'] / 2**20:.0f}"


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for anchors in sorted({p["anchors"] for p in points}):
        for ckpt, style in ((False, "-"), (True, "--")):
            ps = sorted((p for p in points if p["anchors"] == anchors and p["ckpt"] == ckpt), key=lambda p: p["seq"])
            if not ps:
                continue
            label = f"max_anchors {anchors}{', checkpointing' if ckpt else ''}"
            line, = ax.plot([p["seq"] for p in ps], [p["measured"] / 2**20 for p in ps], style, marker="o",
                            label=f"measured, {label}")
            ax.plot([p["seq"] for p in ps], [p["planned"] / 2**20 for p in ps], style, marker="x",
                    color=line.get_color(), alpha=0.5, label=f"planned, {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("data.seq_length (tokens)")
    ax.set_ylabel("training memory over idle (MiB)")
    ax.set_title("Tiny draft training on CPU: peak RSS - idle RSS vs the memory plan")
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":
        return probe(Path(sys.argv[2]), sys.argv[4:])
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--anchors", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=2, help="train.max_steps of each point")
    ap.add_argument("--rows", type=int, default=512, help="data.limit: rows packed into the sequences")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--plot", type=Path, help="write the planned-vs-measured figure here (png)")
    ap.add_argument("--points-json", type=Path, help="also write every point (planned, measured) here")
    ap.add_argument("--from-points", type=Path, help="measure nothing: re-plan the points of an earlier "
                                                      "--points-json (the measured figures are kept)")
    args = ap.parse_args()
    if args.from_points:
        points = json.loads(args.from_points.read_text())
        for p in points:
            p["planned"] = planned_bytes(args, p["seq"], p["anchors"], p["ckpt"])
            p["error"] = (p["planned"] - p["measured"]) / p["measured"]
        return report(args, points)
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.steps import run_stage

    base = base_sets(args)
    tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    points = []
    try:
        wd = tmp / "run"
        res = Resolved(load_recipe(REPO / "recipes" / "tiny-cpu.yaml", base), wd)
        run_stage("prepare", res)
        run_stage("hidden-states", res)
        for seq in args.seq_lengths:
            for anchors in args.anchors:
                for ckpt in (False, True):
                    sets = [*base, f"data.seq_length={seq}", f"train.max_anchors={anchors}",
                            f"train.gradient_checkpointing={str(ckpt).lower()}"]
                    r = Resolved(load_recipe(REPO / "recipes" / "tiny-cpu.yaml", sets), wd)
                    m = measure(r, wd, args.steps)
                    measured = m["cuda_step"] if "cuda_step" in m else m["peak"] - m["idle"]
                    planned = planned_bytes(args, seq, anchors, ckpt)
                    points.append({"seq": seq, "anchors": anchors, "ckpt": ckpt, "planned": planned,
                                   "measured": measured, "idle": m["idle"], "wall_s": m["wall_s"],
                                   "step_s": m.get("step_s", []),
                                   "accept_len": m["accept_len"], "error": (planned - measured) / measured})
                    print(f"seq {seq} anchors {anchors} ckpt {ckpt}: planned {planned / 2**20:.1f} MiB, measured "
                          f"{measured / 2**20:.1f} MiB ({points[-1]['error']:+.1%}), {m['wall_s']:.1f}s, "
                          f"accept_len {m['accept_len']}; first step MiB {phases_mib(m)}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report(args, points)


def base_sets(args) -> list[str]:
    return [f"train.device={args.device}", "regen.enabled=false", f"data.limit={args.rows}", "train.epochs=1",
            f"train.max_steps={args.steps}", "train.logger=none", "train.num_workers=0",
            f"data.seq_length={max(args.seq_lengths)}"]


def planned_bytes(args, seq: int, anchors: int, ckpt: bool) -> int:
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved

    sets = [*base_sets(args), f"data.seq_length={seq}", f"train.max_anchors={anchors}",
            f"train.gradient_checkpointing={str(ckpt).lower()}"]
    return Resolved(load_recipe(REPO / "recipes" / "tiny-cpu.yaml", sets), planning=True).memory_plan.step_bytes


def report(args, points: list[dict]) -> None:
    if args.points_json:
        args.points_json.write_text(json.dumps(points, indent=1))
    if args.plot:
        plot(points, args.plot)
    worst = max(points, key=lambda p: abs(p["error"]))
    rows = [Row("memory", f"seq {p['seq']}, max_anchors {p['anchors']}{', ckpt' if p['ckpt'] else ''}: planned / measured",
                p["planned"] / p["measured"], "x", f"within {GOAL:.0%}", abs(p["error"]) <= GOAL,
                notes=f"planned {p['planned'] / 2**20:.1f} MiB, measured {p['measured'] / 2**20:.1f} MiB over idle "
                      f"{p['idle'] / 2**20:.0f} MiB; {p['wall_s']:.1f}s; val accept_len {p['accept_len']}")
            for p in points]
    rows.append(Row("memory", "worst |planned - measured| / measured", abs(worst["error"]), "x", f"<= {GOAL}",
                    abs(worst["error"]) <= GOAL, notes=f"seq {worst['seq']}, max_anchors {worst['anchors']}, "
                                                       f"checkpointing {worst['ckpt']}"))
    pairs = [(a, b) for a in points for b in points
             if not a["ckpt"] and b["ckpt"] and (a["seq"], a["anchors"]) == (b["seq"], b["anchors"])]
    if pairs:
        def step(p: dict) -> float:  # the median step after the first (imports and first-call costs), else the wall
            return statistics.median(p["step_s"]) if p.get("step_s") else p["wall_s"]

        ratio = statistics.median(step(b) / step(a) for a, b in pairs)
        saved = sorted(1 - b["measured"] / a["measured"] for a, b in pairs)[len(pairs) // 2]
        same = sum(a["accept_len"] == b["accept_len"] for a, b in pairs)
        rows.append(Row("memory", "checkpointing: step time with / without (median over pairs)", ratio, "x",
                        notes=f"{len(pairs)} pairs; memory saved (median) {saved:.0%}; val accept_len identical "
                              f"in {same} of {len(pairs)} pairs"))
    cmd = " ".join([f"--seq-lengths {' '.join(map(str, args.seq_lengths))}",
                    f"--anchors {' '.join(map(str, args.anchors))}", f"--steps {args.steps}", f"--rows {args.rows}"])
    emit(rows, args.json, this_command("bench_memory.py", cmd))


if __name__ == "__main__":
    main()
