"""Stages as library functions, and `run`: a resumable pipeline over them.

Each stage takes (recipe, workdir) and returns a summary dict with one key
figure. `run` records a fingerprint per finished stage (hash of the recipe
sections it reads + upstream fingerprints) in `<workdir>/state.json`; a rerun
skips unchanged stages, reruns changed ones and everything downstream, and
interrupted stages resume by themselves (regen skips written rows, hidden
states skip valid files, training resumes from its last checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dspark_kit import atomic
from dspark_kit.progress import note, tee_stderr
from dspark_kit.recipe import Recipe

STAGES = ["regen", "prepare", "hidden-states", "train", "eval", "serve", "bench", "report"]


@dataclass
class Stage:
    name: str
    sections: tuple[str, ...]  # recipe sections whose change invalidates the stage
    run: Callable[[Recipe, Path], dict]
    key: str  # summary field shown in the final table


def verifier_path(recipe: Recipe) -> str:
    from dspark_kit.tiny import resolve_verifier_path

    return resolve_verifier_path(recipe.verifier.path)


def regen_file(workdir: Path) -> Path:
    return workdir / "regen.jsonl"


# ---- stages -----------------------------------------------------------------


def stage_regen(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.regen import run_regen

    return run_regen(recipe, regen_file(workdir), resume=True)


def prepare_input_rows(recipe: Recipe, workdir: Path):
    """Regen output when present, else the recipe's data source as is."""
    from dspark_kit.prepare import read_jsonl

    f = regen_file(workdir)
    if f.exists():
        return read_jsonl(f), sum(1 for line in f.open() if line.strip())
    from dspark_kit.sources import iter_source

    rows = [{"messages": msgs} for _, msgs in iter_source(recipe.data)]
    return rows, len(rows)


def stage_prepare(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.prepare import prepare

    rows, total = prepare_input_rows(recipe, workdir)
    s = prepare(
        rows, verifier_path(recipe), workdir / "prepared",
        seq_length=recipe.data.seq_length, thinking=recipe.verifier.thinking,
        num_workers=recipe.data.num_workers, seed=recipe.train.seed,
        trust_remote_code=recipe.verifier.trust_remote_code, total=total,
        meta={"verifier": recipe.verifier.path, "source": str(regen_file(workdir)) if regen_file(workdir).exists() else recipe.data.source},
    )
    return s.as_dict()


def stage_hidden_states(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.verifier import num_hidden_layers

    if recipe.hidden_states.mode == "online":
        return {"skipped": "hidden_states.mode is online: the trainer asks a server"}
    if recipe.hidden_states.backend != "local":
        from dspark_kit.hidden_states_vllm import run_offline_vllm

        return run_offline_vllm(recipe, workdir)
    from dspark_kit.devices import detect_device
    from dspark_kit.hidden_states import generate_offline

    vp = verifier_path(recipe)
    n = num_hidden_layers(recipe)
    device = detect_device(recipe.train.device)
    s = generate_offline(
        workdir / "prepared", vp, recipe.exported_layer_ids(n), device=device,
        dtype="float32" if device == "cpu" else recipe.verifier.dtype,
        out_dtype=recipe.hidden_states.dtype, trust_remote_code=recipe.verifier.trust_remote_code,
    )
    return s.as_dict()


def train_args(recipe: Recipe, workdir: Path, hidden_states_endpoint: str | None = None,
               planning: bool = False) -> tuple[list[str], str]:
    """speculators train flags for this recipe, and the device they are for.

    `planning` (dry runs) plans for an explicit train.device even when this
    machine does not have it, so an Ascend command can be checked on a laptop.
    """
    from dspark_kit.devices import detect_device
    from dspark_kit.train import build_train_args
    from dspark_kit.verifier import num_hidden_layers

    wanted = recipe.train.device
    device = wanted if planning and wanted != "auto" else detect_device(wanted)
    args = build_train_args(recipe, workdir, verifier_path=verifier_path(recipe), device=device,
                            num_hidden_layers=num_hidden_layers(recipe), hidden_states_endpoint=hidden_states_endpoint)
    return args, device


def train_plan(recipe: Recipe, workdir: Path, hidden_states_endpoint: str | None = None):
    from dspark_kit.train import launch_plan

    args, device = train_args(recipe, workdir, hidden_states_endpoint)
    return launch_plan(recipe, args, device)


def stage_train(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.manifest import update_manifest
    from dspark_kit.preflight import enforce
    from dspark_kit.train import read_val_metrics, run_training, set_aside_incomplete_checkpoints

    enforce(recipe, workdir, "train")
    for d in set_aside_incomplete_checkpoints(workdir / "checkpoints"):
        note(f"train: {d.name} was cut off mid-save by an earlier run; kept aside, resuming from the last whole epoch")
    t0 = time.time()
    if recipe.hidden_states.mode == "online":
        from dspark_kit.servers import hidden_state_server

        ctx = hidden_state_server(recipe, workdir)
    else:
        from contextlib import nullcontext

        ctx = nullcontext(None)
    with ctx as endpoint:
        plan = train_plan(recipe, workdir, endpoint)
        update_manifest(workdir, recipe, "train", argv=plan.argv, env=plan.env)
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        code = run_training(plan, workdir / "logs" / "train.log")
    if code != 0:
        raise RuntimeError(f"speculators train exited with {code}; see {workdir / 'logs' / 'train.log'}")
    metrics = read_val_metrics(workdir / "checkpoints") or {}
    return {"seconds": round(time.time() - t0, 1), **metrics}


# ---- dry runs: each stage's commands, what `<stage> --dry-run` prints ------------


def regen_dry_run(recipe: Recipe, endpoints: list[str] | None = None) -> tuple[list[str], str | None]:
    """Endpoints regen would use, and the local engine command it would start when there are none."""
    endpoints = list(endpoints or recipe.regen.endpoints)
    if endpoints:
        return endpoints, None
    from dspark_kit.servers import regen_server_plan

    return endpoints, regen_server_plan(recipe).shell_line()


def hidden_states_dry_run(recipe: Recipe, workdir: Path) -> list[str]:
    if recipe.hidden_states.mode == "online" or recipe.hidden_states.backend == "local":
        return [(f"# nothing to launch: hidden_states mode={recipe.hidden_states.mode} "
                 f"backend={recipe.hidden_states.backend} runs in-process (or inside train)")]
    from dspark_kit.hidden_states_vllm import dry_run_lines

    return dry_run_lines(recipe, workdir)


def train_dry_run(recipe: Recipe, workdir: Path) -> list[str]:
    """The exact training command(s), one per node (raises RecipeError/RuntimeError when unplannable)."""
    from dspark_kit.train import node_plans

    hs = recipe.hidden_states
    endpoint = hs.endpoint or (f"http://{recipe.serve.host}:{recipe.serve.hidden_states_port}"
                               if hs.mode == "online" else None)
    args, device = train_args(recipe, workdir, endpoint, planning=True)
    plans = node_plans(recipe, args, device)
    if len(plans) == 1:
        return [plans[0].shell_line()]
    return [line for i, p in enumerate(plans) for line in (f"# node {i}", p.shell_line())]


def _spec_server_dry_run(recipe: Recipe, workdir: Path, what: str) -> list[str]:
    from dspark_kit.servers import server_plan

    ckpt = Path(workdir) / "checkpoints" / recipe.serve.checkpoint  # resolved once training has run
    try:
        plan = server_plan(recipe, "spec", checkpoint=ckpt, workdir=workdir)
    except (ValueError, OSError) as e:
        return [f"# {what}: cannot plan the spec server before training ({e})"]
    return [f"# {what}: spec server (checkpoint resolved from {ckpt} after train)", plan.shell_line(),
            *(f"# note: {n}" for n in plan.notes)]


def stage_dry_run(recipe: Recipe, workdir: Path, name: str) -> list[str]:
    """What stage `name` would launch, as printable lines (commands, or a note for in-process work)."""
    workdir = Path(workdir)
    if name == "regen":
        if not recipe.regen.enabled:
            return ["# regen disabled (regen.enabled: false)"]
        endpoints, command = regen_dry_run(recipe)
        return [command] if command else [f"# endpoint {e}" for e in endpoints]
    if name == "prepare":
        src = regen_file(workdir) if recipe.regen.enabled else recipe.data.source
        return [f"# in-process: tokenize {src} with {recipe.verifier.path}'s chat template -> {workdir / 'prepared'}"]
    if name == "hidden-states":
        return hidden_states_dry_run(recipe, workdir)
    if name == "train":
        hs, lines = recipe.hidden_states, []
        if hs.mode == "online" and not hs.endpoint:  # train starts the extraction server itself
            from dspark_kit.servers import server_plan

            plan = server_plan(recipe, "hidden-states", port=recipe.serve.hidden_states_port, workdir=workdir)
            lines = ["# hidden-state server train starts (online mode)", plan.shell_line()]
        return [*lines, *train_dry_run(recipe, workdir)]
    if name == "eval":
        return [f"# in-process: offline acceptance of {recipe.serve.checkpoint} -> {workdir / 'eval'}"]
    if name == "serve":
        return _spec_server_dry_run(recipe, workdir, "serve check")
    if name == "bench":
        return [*_spec_server_dry_run(recipe, workdir, "bench"),
                f"# in-process: benchmark that server -> {workdir / 'bench'}"]
    if name == "report":
        return [f"# in-process: report -> {workdir / 'report' / 'report.md'}"]
    raise ValueError(f"unknown stage {name!r}")


def pipeline_dry_run(recipe: Recipe, workdir: Path, stages: list[str] | None = None,
                     start: str | None = None) -> list[str]:
    """`run --dry-run`: every selected stage's dry-run output, in pipeline order."""
    lines: list[str] = []
    for name in resolve_stages(stages, start):
        lines += [f"# ==> {name}", *stage_dry_run(recipe, workdir, name)]
    return lines


def _lazy(module: str, func: str) -> Callable[[Recipe, Path], dict]:
    def call(recipe: Recipe, workdir: Path) -> dict:
        import importlib

        return getattr(importlib.import_module(module), func)(recipe, workdir)

    return call


REGISTRY: dict[str, Stage] = {
    s.name: s
    for s in [
        Stage("regen", ("verifier", "data", "regen"), stage_regen, "written"),
        Stage("prepare", ("verifier", "data"), stage_prepare, "rows_out"),
        Stage("hidden-states", ("verifier", "hidden_states"), stage_hidden_states, "generated"),
        Stage("train", ("draft", "train", "hidden_states"), stage_train, "accept_len_epoch"),
        Stage("eval", ("eval", "serve"), _lazy("dspark_kit.evaluate", "stage_eval"), "acceptance_length"),
        Stage("serve", ("serve",), _lazy("dspark_kit.serve_stage", "stage_serve_check"), "engine"),
        Stage("bench", ("bench", "serve"), _lazy("dspark_kit.bench", "stage_bench"), "acceptance_length"),
        Stage("report", (), _lazy("dspark_kit.report", "stage_report"), "path"),
    ]
}


# ---- fingerprints and state -------------------------------------------------


def fingerprint(recipe: Recipe, stage: Stage, upstream: str) -> str:
    dump = recipe.model_dump(mode="json")
    blob = json.dumps({k: dump[k] for k in stage.sections}, sort_keys=True) + upstream
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_state(workdir: Path) -> dict:
    f = workdir / "state.json"
    return json.loads(f.read_text()) if f.exists() else {}


def save_state(workdir: Path, state: dict) -> None:
    atomic.write_text(workdir / "state.json", json.dumps(state, indent=2, default=str))


def resolve_stages(stages: list[str] | None, start: str | None) -> list[str]:
    chosen = stages or list(STAGES)
    unknown = [s for s in chosen if s not in REGISTRY]
    if unknown:
        raise ValueError(f"--stages: unknown {unknown}; choose from {', '.join(STAGES)}")
    chosen = [s for s in STAGES if s in chosen]  # pipeline order
    if start:
        if start not in chosen:
            raise ValueError(f"--from {start}: not among the selected stages {chosen}")
        chosen = chosen[chosen.index(start):]
    return chosen


def replay_recipe(run_dir: Path) -> tuple[Recipe, list[str], list[str]]:
    """The recipe and stages a run recorded in its manifest, plus what differs from here and now."""
    from dspark_kit.devices import versions
    from dspark_kit.manifest import git_info, load_manifest
    from dspark_kit.recipe import recipe_from_dict

    m = load_manifest(Path(run_dir))
    if "recipe" not in m:
        raise ValueError(f"--replay {run_dir}: no manifest.json with a recipe there")
    recipe = recipe_from_dict(m["recipe"], f"{run_dir}/manifest.json")
    stages = [s for s in STAGES if s in m.get("stages", {})] or None
    diffs = []
    if (m.get("git") or {}).get("sha") not in (None, git_info()["sha"]):
        diffs.append(f"code: run used git {m['git']['sha'][:10]}, this checkout is {str(git_info()['sha'])[:10]}")
    then = (m.get("devices") or {}).get("versions") or {}
    diffs += [f"{k}: run used {v}, here {versions().get(k)}" for k, v in then.items() if versions().get(k) != v]
    return recipe, stages or list(STAGES), diffs


def run_pipeline(recipe: Recipe, workdir: Path, stages: list[str] | None = None, start: str | None = None,
                 force: bool = False, log=note) -> list[dict]:
    """Run stages in order; returns one row per stage for the summary table."""
    from dspark_kit.manifest import update_manifest

    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    chosen = resolve_stages(stages, start)
    state = load_state(workdir)
    update_manifest(workdir, recipe)
    upstream, dirty, rows = "", force, []
    forced_from = chosen[0] if start else None
    for name in STAGES:
        stage = REGISTRY[name]
        fp = fingerprint(recipe, stage, upstream)
        prev = state.get(name, {})
        if name not in chosen:
            # an unselected stage keeps its recorded fingerprint as the upstream of the next
            upstream = prev.get("fingerprint", fp) if prev.get("status") == "done" else fp
            continue
        dirty = dirty or name == forced_from
        if not dirty and prev.get("status") == "done" and prev.get("fingerprint") == fp:
            rows.append({"stage": name, "status": "skipped (unchanged)", "seconds": 0.0,
                         "figure": prev.get("figure")})
            upstream = fp
            continue
        dirty = True  # everything downstream of a rerun stage reruns
        log(f"==> {name}")
        state[name] = {"status": "running", "fingerprint": fp, "started": time.time()}
        save_state(workdir, state)
        t0 = time.time()
        try:
            with tee_stderr(workdir / "logs" / f"stage-{name}.log"):
                summary = stage.run(recipe, workdir)
        except BaseException:
            state[name]["status"] = "failed"
            save_state(workdir, state)
            raise
        secs = round(time.time() - t0, 1)
        figure = summary.get(stage.key)
        state[name] = {"status": "done", "fingerprint": fp, "seconds": secs, "figure": figure}
        save_state(workdir, state)
        update_manifest(workdir, recipe, name, seconds=secs, summary=summary)
        rows.append({"stage": name, "status": "done", "seconds": secs, "figure": figure})
        upstream = fp
    return rows


def highlights(workdir: Path) -> list[str]:
    """Where the results are, with the figures that matter, for the end of a run."""
    from dspark_kit.train import read_val_metrics

    workdir = Path(workdir)
    lines = []
    val = read_val_metrics(workdir / "checkpoints")
    if val:
        lines.append(f"checkpoint: {val['checkpoint']}  (val accept_len {val.get('accept_len_epoch', float('nan')):.3f}, "
                     "teacher-forced)")
    ev = workdir / "eval" / "eval.json"
    if ev.exists():
        e = json.loads(ev.read_text())
        pos = ", ".join(f"{p:.3f}" for p in e.get("per_position_acceptance", []))
        lines.append(f"eval: acceptance length {e['acceptance_length']:.3f} (autoregressive), per position [{pos}]")
    for b in sorted((workdir / "bench").glob("bench_*.json")):
        spec = json.loads(b.read_text()).get("spec_decode") or {}
        if spec:
            lines.append(f"bench: {b.name}: acceptance length {spec['acceptance_length']:.3f} from /metrics")
    rep = workdir / "report" / "report.md"
    if rep.exists():
        lines.append(f"report: {rep}")
    return lines
