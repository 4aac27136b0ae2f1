"""Stages as library functions, and `run`: a resumable pipeline over them.

Each stage takes a `Resolved` (the pipeline's, afresh after each stage) and returns a summary dict with one key
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
from pathlib import Path

from dspark_kit import atomic
from dspark_kit.progress import StageDisplay
from dspark_kit.recipe import Recipe
from dspark_kit.resolved import Resolved
from dspark_kit.rundir import RunDir, bench_result_files
from dspark_kit.stages.plan import StagePlan
from dspark_kit.stages.steps import REGISTRY, STAGES, Stage, execute


def pipeline_plans(res: Resolved, stages: list[str] | None = None, start: str | None = None) -> list[StagePlan]:
    """Every selected stage's plan in pipeline order (`res` is a planning Resolved: nothing is built
    or trained)."""
    return [REGISTRY[name].plan(res) for name in resolve_stages(stages, start)]


def pipeline_dry_run(res: Resolved, stages: list[str] | None = None, start: str | None = None,
                     plans: list[StagePlan] | None = None) -> list[str]:
    """`run --dry-run`: the run's decided values, then every selected stage's plan as printed."""
    lines: list[str] = ["# resolved (where each value came from):", *res.summary_lines()]
    for plan in plans if plans is not None else pipeline_plans(res, stages, start):
        lines += [f"# ==> {plan.stage}", *plan.lines]
    return lines


# ---- fingerprints and state -------------------------------------------------


# Where a stage runs, not what it computes: the keys a multi-node launch sets per node or per
# allocation (node rank, the rendezvous host, the address of a server on another node). A run
# resubmitted onto other nodes is the same run: these never change a fingerprint.
PLACEMENT_KEYS = {"train": ("node_rank", "master_addr"), "hidden_states": ("endpoint",),
                  "regen": ("endpoints",)}


# How a stage gets its result, not what it is: files linked from an earlier run are the values this
# run would compute (stages/hidden/reuse.py checks that), so naming one never reruns a finished stage.
SAME_RESULT_KEYS = {"hidden_states": ("reuse_from",)}


def fingerprint(recipe: Recipe, stage: Stage, upstream: str) -> str:
    dump = recipe.model_dump(mode="json")
    for section, keys in (*PLACEMENT_KEYS.items(), *SAME_RESULT_KEYS.items()):
        for k in keys:
            dump[section].pop(k, None)
    dump["hidden_states"]["mooncake"].pop("master_host", None)
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


RESULT_LABELS = {  # a stage's key figure, as its one-line result says it
    "written": "rows regenerated", "rows_out": "training rows", "generated": "hidden-state files written",
    "accept_len_epoch": "val accept_len (teacher-forced)", "acceptance_length": "acceptance length",
    "engine": "engine", "path": "report",
}


def stage_result(stage: Stage, summary: dict) -> str:
    """The stage's one-line result: its key figure, labelled."""
    figure = summary.get(stage.key)
    if figure is None:
        return str(summary["skipped"]) if "skipped" in summary else "done"
    shown = f"{figure:.3f}" if isinstance(figure, float) else str(figure)
    return f"{RESULT_LABELS.get(stage.key, stage.key)} {shown}"


def stage_fingerprint(res: Resolved, name: str, state: dict) -> str:
    """The fingerprint `run` gives stage `name` when the stages before it stand as `state` records
    them (a finished one by its recorded fingerprint, any other by today's recipe)."""
    return stage_decisions(res.recipe, state, [name])[0][2]


def record_stage(res: Resolved, state: dict, name: str, fp: str, summary: dict | None, seconds: float) -> None:
    """A stage's end, the one way `run` and every stage command record it: DIR/state.json (status,
    fingerprint, time and key figure: a later `run` skips a finished, unchanged stage) and the
    manifest. `summary` None: the stage failed (state says so; the manifest is left as it was)."""
    from dspark_kit.stages.manifest import update_manifest

    if summary is None:
        state[name] = {**state.get(name, {}), "status": "failed"}
        save_state(res.run.root, state)
        return
    state[name] = {"status": "done", "fingerprint": fp, "seconds": seconds, "figure": summary.get(REGISTRY[name].key)}
    save_state(res.run.root, state)
    update_manifest(res.run.root, res.recipe, name, resolved=res, seconds=seconds, summary=summary)


def record_standalone(res: Resolved, name: str, summary: dict, seconds: float) -> None:
    """A stage command that ran the stage as `run` would (e.g. `dspark-kit regen` with no option that
    changes its rows) records it as `run` does."""
    state = load_state(res.run.root)
    record_stage(res, state, name, stage_fingerprint(res, name, state), summary, seconds)


def _started(res: Resolved, state: dict, name: str, fp: str) -> None:
    state[name] = {"status": "running", "fingerprint": fp, "started": time.time()}
    save_state(res.run.root, state)


def run_one_stage(res: Resolved, name: str, reporter=None) -> dict:
    """A stage command (`dspark-kit train`, ...): the stage's plan, run as `run` runs it and recorded
    as `run` records it (record_stage), so a later `run` on the folder skips it when unchanged."""
    from dspark_kit.progress import STANDALONE

    res.run.root.mkdir(parents=True, exist_ok=True)
    state = load_state(res.run.root)  # read before the stage: its fingerprint is the one `run` gives it
    fp = stage_fingerprint(res, name, state)
    _started(res, state, name, fp)
    t0 = time.time()
    try:
        summary = execute(REGISTRY[name], res, reporter or STANDALONE)
    except BaseException:
        record_stage(res.afresh(), state, name, fp, None, 0.0)
        raise
    # recorded with what the stage left (a checkpoint, a tune) decided afresh
    record_stage(res.afresh(), state, name, fp, summary, round(time.time() - t0, 1))
    return summary


def run_pipeline(res: Resolved, stages: list[str] | None = None, start: str | None = None,
                 force: bool = False, display: StageDisplay | None = None) -> list[dict]:
    """Run stages in order, each with `res` resolved afresh after the stage before it, shown by `display` (one line per stage;
    default: everything streamed); returns one row per stage for the summary table."""
    if display is None:
        with StageDisplay(verbose=True) as streamed:
            return run_pipeline(res, stages, start, force, streamed)
    from dspark_kit.stages.manifest import update_manifest

    recipe, workdir = res.recipe, res.run.root
    workdir.mkdir(parents=True, exist_ok=True)
    state = load_state(workdir)
    update_manifest(workdir, recipe, resolved=res)
    rows = []
    for name, decision, fp in stage_decisions(recipe, state, stages, start, force):
        stage = REGISTRY[name]
        if decision != "run":
            figure = state.get(name, {}).get("figure") if decision == "skipped (unchanged)" else None
            rows.append({"stage": name, "status": decision, "seconds": 0.0, "figure": figure})
            display.result(name, decision)
            continue
        _started(res, state, name, fp)
        t0 = time.time()
        try:
            with display.stage(name, res.run.stage_log(name)):
                summary = execute(stage, res, display.reporter)
        except BaseException:
            record_stage(res.afresh(), state, name, fp, None, 0.0)
            raise
        # what the stage wrote (a checkpoint, a tune) changes what the next one reads: it resolves afresh
        res = res.afresh()
        secs = round(time.time() - t0, 1)
        record_stage(res, state, name, fp, summary, secs)
        rows.append({"stage": name, "status": "done", "seconds": secs, "figure": summary.get(stage.key)})
        display.result(name, stage_result(stage, summary), secs)
    return rows


def stage_decisions(recipe: Recipe, state: dict, stages: list[str] | None = None, start: str | None = None,
                    force: bool = False) -> list[tuple[str, str, str]]:
    """(stage, decision, fingerprint) for each selected stage, in order: "run", "skipped (unchanged)"
    or "skipped (regen.enabled false)". The one rule `run` follows, and `run --launcher slurm` asks
    before it writes the job: finished stages with unchanged inputs are skipped; a changed or
    unfinished one reruns, and everything downstream of it."""
    chosen = resolve_stages(stages, start)
    upstream, dirty, out = "", force, []
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
            out.append((name, "skipped (regen.enabled false)", fp))
            continue
        if not dirty and prev.get("status") == "done" and prev.get("fingerprint") == fp:
            out.append((name, "skipped (unchanged)", fp))
        else:
            dirty = True  # everything downstream of a rerun stage reruns
            out.append((name, "run", fp))
        upstream = fp
    return out


def highlights(workdir: Path) -> list[str]:
    """Where the results are, with the figures that matter, for the end of a run."""
    from dspark_kit.stages.training.train import read_val_metrics

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
    from dspark_kit.measure.served_gate import side_by_side

    for b in bench_result_files(run.bench):
        try:
            result = json.loads(b.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # the report names what it cannot read
        spec = result.get("spec_decode") or {}
        if spec:
            lines.append(f"bench: {b.name}: acceptance length {spec['acceptance_length']:.3f} from /metrics")
        if result.get("in_process", {}).get("served_acceptance_length") is not None:
            lines.append(f"bench: {side_by_side(result['in_process'])}")
    rep = run.report_md
    if rep.exists():
        lines.append(f"report: {rep}")
    measured = json.loads(ev.read_text()) if ev.exists() else {}
    categories = measured.get("categories")
    if categories:  # last: the figure to compare drafts by
        from dspark_kit.stages.evaluation.eval_outputs import category_markdown, temperature_words

        lines += [f"eval: acceptance per category, {temperature_words(measured.get('temperature'))}",
                  *category_markdown(categories)[3:]]
    return lines
