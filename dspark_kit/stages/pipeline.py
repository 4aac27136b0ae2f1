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
from dspark_kit.resolved import Resolved
from dspark_kit.rundir import RunDir

STAGES = ["regen", "prepare", "hidden-states", "train", "eval", "serve", "bench", "report"]


@dataclass
class Stage:
    name: str
    sections: tuple[str, ...]  # recipe sections whose change invalidates the stage
    run: Callable[[Recipe, Path], dict]
    key: str  # summary field shown in the final table


def verifier_path(recipe: Recipe) -> str:
    return Resolved(recipe).verifier_path


def regen_file(workdir: Path) -> Path:
    return RunDir.at(workdir).regen_jsonl


# ---- stages -----------------------------------------------------------------


def stage_regen(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.stages.regen import run_regen

    s = run_regen(recipe, regen_file(workdir), resume=True)
    note(f"regen: {s['written']} written, {s['failed']} failed, {s['not_attempted']} not attempted, "
         f"{s['skipped_already_done']} already done, {sum(s['skipped_rows'].values())} unusable "
         f"of {s['source_rows']} source rows")
    for reason, n in {**s["failed_reasons"], **s["skipped_rows"]}.items():
        note(f"  {n}: {reason}")
    return s


def prepare_input_rows(recipe: Recipe, workdir: Path):
    """(rows, total, rows the reader could not use, source): DIR/regen.jsonl when regen is part of
    the recipe (a missing one is an error, not a silent fall-back to the raw data), else the
    recipe's data source as is."""
    from collections import Counter

    from dspark_kit.stages.prepare import read_jsonl

    f = regen_file(workdir)
    if recipe.regen.enabled:
        if not f.exists():
            raise ValueError(f"{f} not found: run regen first (dspark-kit regen -w {workdir}), "
                             "or set regen.enabled=false to prepare data.source as is")
        return read_jsonl(f), sum(1 for line in f.open() if line.strip()), Counter(), str(f)
    from dspark_kit.data.sources import iter_source

    skipped: Counter = Counter()
    rows = [{"messages": msgs} for _, msgs in iter_source(recipe.data, skipped=skipped)]
    return rows, len(rows), skipped, recipe.data.source


def stage_prepare(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.stages.prepare import prepare

    rows, total, unusable, source = prepare_input_rows(recipe, workdir)
    s = prepare(
        rows, verifier_path(recipe), RunDir.at(workdir).prepared,
        seq_length=recipe.data.seq_length, thinking=recipe.verifier.thinking,
        num_workers=recipe.data.num_workers, seed=recipe.train.seed,
        trust_remote_code=recipe.verifier.trust_remote_code, total=total,
        keep_truncated=recipe.data.keep_truncated, pre_rejected=unusable,
        meta={"verifier": recipe.verifier.path, "source": source},
    )
    return s.as_dict()


def stage_hidden_states(recipe: Recipe, workdir: Path) -> dict:
    if recipe.hidden_states.mode == "online":
        return {"skipped": "hidden_states.mode is online: the trainer asks a server"}
    if recipe.hidden_states.backend != "local":
        from dspark_kit.stages.hidden_states_vllm import run_offline_vllm

        return run_offline_vllm(recipe, workdir)
    from dspark_kit.devices import detect_device
    from dspark_kit.stages.hidden_states import generate_offline

    res = Resolved(recipe, workdir)
    device = detect_device(recipe.train.device)
    s = generate_offline(
        res.run.prepared, res.verifier_path, res.exported_layer_ids, device=device,
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
    from dspark_kit.stages.train import build_train_args

    wanted = recipe.train.device
    device = wanted if planning and wanted != "auto" else detect_device(wanted)
    res = Resolved(recipe, workdir, planning=planning)
    args = build_train_args(recipe, workdir, verifier_path=res.verifier_path, device=device,
                            num_hidden_layers=res.num_hidden_layers, hidden_states_endpoint=hidden_states_endpoint)
    return args, device


def train_plan(recipe: Recipe, workdir: Path, hidden_states_endpoint: str | None = None):
    from dspark_kit.stages.train import launch_plan

    args, device = train_args(recipe, workdir, hidden_states_endpoint)
    return launch_plan(recipe, args, device)


def stage_train(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.stages.manifest import update_manifest
    from dspark_kit.stages.preflight import enforce
    from dspark_kit.stages.train import (
        read_val_metrics,
        run_training,
        set_aside_incomplete_checkpoints,
        training_failure,
    )

    run = RunDir.at(workdir)
    enforce(recipe, workdir, "train")
    for d in set_aside_incomplete_checkpoints(run.checkpoints):
        note(f"train: {d.name} was cut off mid-save by an earlier run; kept aside, resuming from the last whole epoch")
    t0 = time.time()
    if recipe.hidden_states.mode == "online":
        from dspark_kit.engines.servers import hidden_state_server

        ctx = hidden_state_server(Resolved(recipe, run))
    else:
        from contextlib import nullcontext

        ctx = nullcontext(None)
    with ctx as endpoint:
        plan = train_plan(recipe, workdir, endpoint)
        update_manifest(workdir, recipe, "train", argv=plan.argv, env=plan.env)
        run.logs.mkdir(parents=True, exist_ok=True)
        log = run.log("train.log")
        since = log.stat().st_size if log.exists() else 0
        code = run_training(plan, log)
    if code != 0:
        raise RuntimeError(training_failure(code, log, since))
    metrics = read_val_metrics(run.checkpoints) or {}
    return {"seconds": round(time.time() - t0, 1), **metrics}


# ---- dry runs: each stage's commands, what `<stage> --dry-run` prints ------------


def hidden_states_dry_run(recipe: Recipe, workdir: Path) -> list[str]:
    """What each node needs for hidden states, and the commands backend vllm would launch."""
    from dspark_kit.stages.hidden_states_vllm import dry_run_lines, node_notes

    hs = recipe.hidden_states
    if hs.backend == "local" and hs.mode == "offline":
        return [*node_notes(recipe, workdir), ("# nothing to launch: hidden_states backend=local runs in-process on "
                                               "this machine (once; every node reads DIR/prepared/hidden_states)")]
    if hs.mode == "online" and hs.backend == "local":
        return ["# online, backend local: `dspark-kit train` starts the kit's own extraction server on each node"]
    return dry_run_lines(recipe, workdir)


def train_dry_run(recipe: Recipe, workdir: Path) -> list[str]:
    """The exact training command(s), one per node with the rendezvous decision (raises
    RecipeError/RuntimeError when unplannable)."""
    from dspark_kit.rendezvous import rendezvous_for
    from dspark_kit.stages.train import node_plans

    hs = recipe.hidden_states
    endpoint = hs.endpoint or (f"http://{recipe.serve.host}:{recipe.serve.hidden_states_port}"
                               if hs.mode == "online" else None)
    args, device = train_args(recipe, workdir, endpoint, planning=True)
    rdzv = rendezvous_for(recipe, device)
    plans = node_plans(recipe, args, device, rdzv)
    if len(plans) == 1:
        return [plans[0].shell_line()]
    lines = [f"# {rdzv.summary()}", *(f"# warning: {w}" for w in rdzv.warnings)]
    if rdzv.backend == "c10d":
        lines.append("# c10d assigns node ranks at rendezvous: every node runs the same command; "
                     "`dspark-kit train` on each node resolves that node's own interface")
    return lines + [line for i, p in enumerate(plans) for line in (f"# node {i}", p.shell_line())]


def _spec_server_dry_run(recipe: Recipe, workdir: Path, what: str) -> list[str]:
    from dspark_kit.stages.serve import ServeError, plan_server

    try:
        sp = plan_server(recipe, RunDir.at(workdir), "spec", planning=True)
    except (ServeError, ValueError, OSError) as e:
        return [f"# {what}: cannot plan the spec server ({e})"]
    return [f"# {what}: spec server on checkpoint {sp.resolved.checkpoint}", sp.plan.shell_line(),
            *(f"# note: {n}" for n in sp.warnings)]


def stage_dry_run(recipe: Recipe, workdir: Path, name: str) -> list[str]:
    """What stage `name` would launch, as printable lines (commands, or a note for in-process work)."""
    run = RunDir.at(workdir)
    if name == "regen":
        if not recipe.regen.enabled:
            return ["# regen disabled (regen.enabled: false)"]
        from dspark_kit.stages.regen import regen_plan, regen_plan_lines

        return regen_plan_lines(regen_plan(recipe, outfile=run.regen_jsonl))
    if name == "prepare":
        src = run.regen_jsonl if recipe.regen.enabled else recipe.data.source
        return [f"# in-process: tokenize {src} with {recipe.verifier.path}'s chat template -> {run.prepared}"]
    if name == "hidden-states":
        return hidden_states_dry_run(recipe, run.root)
    if name == "train":
        hs, lines = recipe.hidden_states, []
        if hs.mode == "online" and not hs.endpoint:  # train starts the extraction server itself
            from dspark_kit.engines.servers import server_plan

            plan = server_plan(Resolved(recipe, run, planning=True), "hidden-states",
                               port=recipe.serve.hidden_states_port)
            lines = ["# hidden-state server train starts (online mode)", plan.shell_line()]
        return [*lines, *train_dry_run(recipe, run.root)]
    if name == "eval":
        return [f"# in-process: offline acceptance of {recipe.serve.checkpoint} -> {run.eval}"]
    if name == "serve":
        return _spec_server_dry_run(recipe, run.root, "serve check")
    if name == "bench":
        return [*_spec_server_dry_run(recipe, run.root, "bench"), f"# in-process: benchmark that server -> {run.bench}"]
    if name == "report":
        return [f"# in-process: report -> {run.report_md}"]
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
        Stage("eval", ("eval", "serve"), _lazy("dspark_kit.stages.evaluate", "stage_eval"), "acceptance_length"),
        Stage("serve", ("serve",), _lazy("dspark_kit.stages.serve", "stage_serve_check"), "engine"),
        Stage("bench", ("bench", "serve"), _lazy("dspark_kit.stages.bench", "stage_bench"), "acceptance_length"),
        Stage("report", (), _lazy("dspark_kit.stages.report", "stage_report"), "path"),
    ]
}


# ---- fingerprints and state -------------------------------------------------


def fingerprint(recipe: Recipe, stage: Stage, upstream: str) -> str:
    dump = recipe.model_dump(mode="json")
    blob = json.dumps({k: dump[k] for k in stage.sections}, sort_keys=True) + upstream
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_state(workdir: Path) -> dict:
    f = RunDir.at(workdir).state
    return json.loads(f.read_text()) if f.exists() else {}


def save_state(workdir: Path, state: dict) -> None:
    atomic.write_text(RunDir.at(workdir).state, json.dumps(state, indent=2, default=str))


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
    from dspark_kit.recipe import recipe_from_dict
    from dspark_kit.stages.manifest import git_info, load_manifest

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
    from dspark_kit.stages.manifest import update_manifest

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
        if name == "regen" and not recipe.regen.enabled:
            rows.append({"stage": name, "status": "skipped (regen.enabled false)", "seconds": 0.0, "figure": None})
            continue
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
            with tee_stderr(RunDir.at(workdir).log(f"stage-{name}.log")):
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
    from dspark_kit.stages.train import read_val_metrics

    run = RunDir.at(workdir)
    lines = []
    val = read_val_metrics(run.checkpoints)
    if val:
        lines.append(f"checkpoint: {val['checkpoint']}  (val accept_len {val.get('accept_len_epoch', float('nan')):.3f}, "
                     "teacher-forced)")
    ev = run.eval_json
    if ev.exists():
        e = json.loads(ev.read_text())
        pos = ", ".join(f"{p:.3f}" for p in e.get("per_position_acceptance", []))
        lines.append(f"eval: acceptance length {e['acceptance_length']:.3f} (autoregressive), per position [{pos}]")
    for b in sorted(run.bench.glob("bench_*.json")):
        spec = json.loads(b.read_text()).get("spec_decode") or {}
        if spec:
            lines.append(f"bench: {b.name}: acceptance length {spec['acceptance_length']:.3f} from /metrics")
    rep = run.report_md
    if rep.exists():
        lines.append(f"report: {rep}")
    return lines
