"""GPU smoke test driver (stdlib only); scripts/gpu_smoke.sh is the entry point.

Runs the kit from this checkout (PYTHONPATH=<site>:<checkout>, `python -m
dspark_kit`), so an offline CUDA machine needs only python + torch (+ the
packages it ships: transformers, typer, rich, aiohttp, ...) and a folder of
wheels for the rest (see docs/GPU_SMOKE.md). Every step runs in a child
process with a time limit; figures go to WORKDIR/gpu_smoke.json after each step
(and to --out DIR, with the step logs), so a run cut short still reports.

Steps (--steps, default all):
  doctor  `dspark-kit doctor --probe-device cuda --json`: every speculators probe ok, and how fast
  run     the full tiny recipe (regen .. report) with train.device=cuda, flex attention
          and fused losses set explicitly (speculators' CUDA defaults)
  eval    acceptance of that run's checkpoint with the reference decoder on cuda
          (beside the run's own cpu eval)
  tests   a test-suite subset (SMOKE_TESTS), with pytest-xdist when present

--check: argument, workdir, wheel and import checks only, then the plan; no GPU needed.
Exit: 0 all steps ok (or --check passed), 1 a step failed, 2 usage/setup error,
3 no CUDA GPU visible.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "recipes/tiny-cpu.yaml"
STEPS = ("doctor", "run", "eval", "tests")
CUDA_SETS = [
    "train.device=cuda",
    "draft.attn_impl=simple_flex_attention",
    "train.loss_implementation=fused",
]
DEFAULT_TIMEOUTS = {"doctor": 120, "run": 420, "eval": 180, "tests": 300}
DEFAULT_TESTS = (
    "tests/test_patches.py tests/test_patches_subprocess.py tests/test_devices.py tests/test_train.py "
    "tests/test_decoder.py"
)
# Imported in --check: what the kit and speculators need beyond torch.
IMPORTS = (
    "torch", "transformers", "speculators", "hs_connectors", "datasets", "pydantic",
    "pydantic_settings", "loguru", "openai", "fastapi", "uvicorn", "typer", "rich",
    "yaml", "safetensors", "dspark_kit",
)  # fmt: skip
LOG_LIMIT = 200_000  # bytes of each step log copied to --out


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/gpu_smoke.sh",
        description="GPU smoke test of dspark-kit on one CUDA machine (offline is fine).",
    )
    p.add_argument("workdir", nargs="?", help="created if missing (default: a fresh temp dir)")
    p.add_argument("--check", action="store_true", help="setup checks and the plan only (no GPU)")
    p.add_argument(
        "--wheels", help="folder of wheels to install into --site (default .gpu/wheels if present)"
    )
    p.add_argument("--site", default=os.environ.get("SMOKE_SITE", "/tmp/site"),
                   help="pip --target folder for the wheels (default /tmp/site)")  # fmt: skip
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--out", help="also write gpu_smoke.json and the step logs here (e.g. $OUT)")
    p.add_argument(
        "--budget", type=float, help="seconds for all steps together; later steps get what is left"
    )
    args = p.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown or not steps:
        p.error(f"--steps: unknown {unknown or 'empty'}; choose from {', '.join(STEPS)}")
    args.steps = [s for s in STEPS if s in steps]
    return args


class Report:
    """gpu_smoke.json, rewritten after every step (a cut-short run still reports)."""

    def __init__(self, workdir: Path, out: Path | None):
        self.paths = [workdir / "gpu_smoke.json"] + ([out / "gpu_smoke.json"] if out else [])
        self.data: dict = {
            "workdir": str(workdir),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def write(self) -> None:
        text = json.dumps(self.data, indent=2, default=str) + "\n"
        for path in self.paths:
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(text)
            tmp.replace(path)


def say(msg: str) -> None:
    print(f"gpu_smoke: {msg}", flush=True)


def install_wheels(wheels: Path, site: Path) -> dict:
    """pip --target install of every wheel but ours (the checkout is on PYTHONPATH)."""
    files = sorted(
        w for w in wheels.glob("*.whl") if not w.name.startswith(("dspark_kit-", "dspark-kit-"))
    )
    if not files:
        raise SystemExit(f"gpu_smoke: --wheels {wheels}: no *.whl files")
    stamp = site / ".gpu_smoke_wheels"
    listing = "\n".join(w.name for w in files)
    if stamp.exists() and stamp.read_text() == listing:
        return {"wheels": len(files), "site": str(site), "installed": "already"}
    t0 = time.time()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--upgrade", "--target", str(site), *map(str, files)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(
            f"gpu_smoke: installing {len(files)} wheels into {site} failed:\n{proc.stderr[-2000:]}"
        )
    stamp.write_text(listing)
    return {"wheels": len(files), "site": str(site), "installed": f"{time.time() - t0:.1f}s"}


def child_env(site: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(site)] if site else []
    path += [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    cache = ROOT / ".gpu" / "cache"
    if "DSPARK_KIT_CACHE" not in env and cache.is_dir():
        env["DSPARK_KIT_CACHE"] = str(cache)  # a carried tiny verifier: no rebuild
    return env


ENV_PROBE = """
import importlib, json, sys
out = {"python": sys.version.split()[0], "modules": {}}
for name in sys.argv[1:]:
    try:
        m = importlib.import_module(name)
        out["modules"][name] = getattr(m, "__version__", "ok")
    except Exception as e:
        out["modules"][name] = f"MISSING: {type(e).__name__}: {e}"
import torch, dspark_kit
out["dspark_kit_from"] = dspark_kit.__file__
out["cuda"] = torch.cuda.is_available()
out["gpu"] = torch.cuda.get_device_name(0) if out["cuda"] else None
out["torch_cuda"] = torch.version.cuda
try:
    import triton
    out["triton"] = triton.__version__
except Exception:
    out["triton"] = None
print(json.dumps(out))
"""


def probe_env(env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", ENV_PROBE, *IMPORTS], capture_output=True, text=True,
                          env=env, cwd=ROOT, check=False, timeout=300)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"gpu_smoke: python environment check failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


EVAL_CUDA = """
import json, sys
from pathlib import Path
from dspark_kit.stages.evaluation.evaluate import evaluate_checkpoint
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
wd, recipe, sets = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
s = evaluate_checkpoint(Resolved(load_recipe(recipe, sets), wd), out_dir=wd / "eval-cuda")  # train.device=cuda: eval there
keys = ("acceptance_length", "per_position_acceptance", "tokens_per_verifier_forward", "num_speculative_tokens")
print("@@" + json.dumps({k: s.get(k) for k in keys}))
"""


def plan(wd: Path, steps: list[str], tests: str) -> dict[str, list[str]]:
    py, run_wd = sys.executable, wd / "run"
    sets = [a for s in CUDA_SETS for a in ("--set", s)]
    cmds = {
        "doctor": [py, "-m", "dspark_kit", "doctor", "--probe-device", "cuda", "--json"],
        "run": [py, "-m", "dspark_kit", "run", RECIPE, "--workdir", str(run_wd), *sets, "--json"],
        "eval": [py, "-c", EVAL_CUDA, str(run_wd), RECIPE, *CUDA_SETS],
        "tests": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests.split()],
    }
    return {s: cmds[s] for s in steps}


def xdist_args(env: dict[str, str]) -> list[str]:
    ok = subprocess.run(
        [sys.executable, "-c", "import xdist"], env=env, capture_output=True, check=False
    )
    return ["-n", str(min(8, os.cpu_count() or 1))] if ok.returncode == 0 else []


def run_step(
    name: str, cmd: list[str], env: dict, timeout: float, log: Path
) -> tuple[int | str, float, str]:
    """(exit code or "timeout", seconds, stdout) of one step; output teed to `log`."""
    t0 = time.time()
    say(f"{name}: {' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''} (limit {timeout:.0f}s)")
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the step and its children (servers, workers)
            out, _ = proc.communicate()
            code = "timeout"
        f.write("\n---- stdout ----\n" + (out or ""))
    return code, round(time.time() - t0, 1), out or ""


def _json_tail(text: str) -> dict | None:
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        return None


def figures(name: str, out: str, wd: Path, log: Path) -> dict:
    """The figures one step produced (best effort: a failed step gives what it can)."""
    if name == "doctor":
        report = _json_tail(out) or {}
        probes = report.get("probes") or []
        return {"probes": {p["name"]: "ok" if p["ok"] else p["detail"] for p in probes},
                "all_ok": bool(probes) and all(p["ok"] for p in probes)}  # fmt: skip
    if name == "run":
        run_wd = wd / "run"
        state = {}
        if (run_wd / "state.json").exists():
            state = json.loads((run_wd / "state.json").read_text())
        stages = {k: {"status": v.get("status"), "seconds": v.get("seconds"), "figure": v.get("figure")}
                  for k, v in state.items() if isinstance(v, dict)}  # fmt: skip
        result: dict = {"stages": stages}
        manifest = run_wd / "manifest.json"
        if manifest.exists():
            argv = (
                json.loads(manifest.read_text()).get("stages", {}).get("train", {}).get("argv")
                or []
            )
            flag = lambda f: argv[argv.index(f) + 1] if f in argv else "(speculators default)"
            result["train_flags"] = {
                f: flag(f) for f in ("--draft-attn-impl", "--loss-implementation")
            }
        best = run_wd / "checkpoints" / "checkpoint_best" / "val_metrics.json"
        if best.exists():
            val = json.loads(best.read_text())
            result["val"] = {k: v for k, v in val.items() if "accept" in k or k.startswith("loss")}
        errors = [
            ln for ln in log.read_text(errors="replace").splitlines() if "error" in ln.lower()
        ]
        if errors:
            result["last_error"] = errors[-1][-500:]
        return result
    if name == "eval":
        marker = out.rpartition("@@")[2]
        result = {"cuda": _json_tail(marker)}
        cpu_eval = wd / "run" / "eval" / "eval.json"
        if cpu_eval.exists():
            result["cpu_acceptance_length"] = json.loads(cpu_eval.read_text()).get(
                "acceptance_length"
            )
        return result
    if name == "tests":
        tail = log.read_text(errors="replace")
        m = re.findall(r"=+ (.*(?:passed|failed|error).*) in [\d.]+s", tail) or re.findall(
            r"^(\d+ (?:passed|failed).*) in [\d.]+s", tail, re.MULTILINE
        )
        counts = (
            {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", m[-1])}
            if m
            else {}
        )
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", tail, re.MULTILINE)
        return {"counts": counts, "failed": failed[:30]}
    return {}


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dspark-gpu-smoke."))
    try:
        wd.mkdir(parents=True, exist_ok=True)
        (wd / "logs").mkdir(exist_ok=True)
    except OSError as e:
        say(f"workdir {wd}: cannot create it ({e})")
        return 2
    wd = wd.resolve()
    out = Path(args.out).resolve() if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    report = Report(wd, out)
    say(f"workdir {wd}")

    wheels = Path(args.wheels) if args.wheels else (ROOT / ".gpu" / "wheels")
    site = None
    if args.wheels and not wheels.is_dir():
        say(f"--wheels {wheels}: no such folder")
        return 2
    if wheels.is_dir():
        site = Path(args.site)
        site.mkdir(parents=True, exist_ok=True)
        report.data["wheels"] = install_wheels(wheels, site)
    env = child_env(site)
    report.data["pythonpath"] = env["PYTHONPATH"]
    info = probe_env(env)
    report.data["env"] = info
    missing = {k: v for k, v in info["modules"].items() if str(v).startswith("MISSING")}
    tests = os.environ.get("SMOKE_TESTS", DEFAULT_TESTS)
    steps = plan(wd, args.steps, tests)
    report.data["plan"] = {
        k: " ".join(v) if k != "eval" else "evaluate_checkpoint (train.device=cuda)" for k, v in steps.items()
    }
    report.data["mode"] = "check" if args.check else "smoke"
    report.write()
    say(f"python {info['python']}, torch {info['modules'].get('torch')}, cuda {info['cuda']} "
        f"({info['gpu'] or 'no GPU'}), dspark_kit from {info['dspark_kit_from']}")  # fmt: skip
    if missing:
        for name, why in missing.items():
            say(f"missing module {name}: {why}")
        say("carry the wheels listed in docs/GPU_SMOKE.md and pass --wheels DIR")
        report.data["missing"] = missing
        report.write()
        return 2
    if args.check:
        for name, cmd in report.data["plan"].items():
            say(f"plan {name}: {cmd}")
        say(f"check ok: {wd / 'gpu_smoke.json'}")
        return 0
    if not info["cuda"]:
        say("no CUDA GPU visible (torch.cuda.is_available() is False); run this on a CUDA machine")
        report.data["error"] = "no CUDA GPU visible"
        report.write()
        return 3

    deadline = time.time() + args.budget if args.budget else None
    results: dict = {}
    report.data["steps"] = results
    for name, cmd in steps.items():
        timeout = float(os.environ.get(f"SMOKE_TIMEOUT_{name.upper()}", DEFAULT_TIMEOUTS[name]))
        if deadline is not None:
            timeout = min(timeout, deadline - time.time())
            if timeout < 10:
                results[name] = {"status": "not run (budget spent)"}
                report.write()
                continue
        if name == "tests":
            cmd = [*cmd, *xdist_args(env)]
        log = wd / "logs" / f"smoke_{name}.log"
        code, secs, stdout = run_step(name, cmd, env, timeout, log)
        results[name] = {"status": "ok" if code == 0 else f"failed ({code})", "seconds": secs,
                         **figures(name, stdout, wd, log)}  # fmt: skip
        if code == 0:
            results[name].pop("last_error", None)  # "error" in an ok run's log is noise
        if out:
            data = log.read_bytes()
            (out / log.name).write_bytes(data[-LOG_LIMIT:])
        report.write()
        say(f"{name}: {results[name]['status']} in {secs}s")
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.write()
    print(json.dumps({"gpu_smoke": {k: {"status": v["status"], "seconds": v.get("seconds")}
                                    for k, v in results.items()}}))  # fmt: skip
    say(f"summary: {wd / 'gpu_smoke.json'}")
    return 0 if all(v["status"] == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
