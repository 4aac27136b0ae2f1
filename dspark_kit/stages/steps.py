"""The eight stages, each with the same small interface: `run` does the work and returns a
summary dict with one key figure, `plan` returns what it would launch (the exact commands,
or a note for in-process work) for `--dry-run`. `REGISTRY` is the one list the pipeline,
`run --dry-run` and every stage command use."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dspark_kit.progress import note
from dspark_kit.recipe import Recipe
from dspark_kit.resolved import Resolved
from dspark_kit.rundir import RunDir


@dataclass(frozen=True)
class Stage:
    name: str
    sections: tuple[str, ...]  # recipe sections whose change invalidates the stage
    run: Callable[[Recipe, Path], dict]  # do it; a summary dict
    plan: Callable[[Recipe, Path], list[str]]  # what it would launch (dry run)
    key: str  # summary field shown in the final table


def stage_regen(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.stages.regen import run_regen

    s = run_regen(recipe, RunDir.at(workdir).regen_jsonl, resume=True)
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

    f = RunDir.at(workdir).regen_jsonl
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
        rows, Resolved(recipe, workdir).verifier_path, RunDir.at(workdir).prepared,
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
        log = run.train_log
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


def plan_regen(recipe: Recipe, workdir: Path) -> list[str]:
    if not recipe.regen.enabled:
        return ["# regen disabled (regen.enabled: false)"]
    from dspark_kit.stages.regen import regen_plan, regen_plan_lines

    return regen_plan_lines(regen_plan(recipe, outfile=RunDir.at(workdir).regen_jsonl))


def plan_prepare(recipe: Recipe, workdir: Path) -> list[str]:
    run = RunDir.at(workdir)
    src = run.regen_jsonl if recipe.regen.enabled else recipe.data.source
    return [f"# in-process: tokenize {src} with {recipe.verifier.path}'s chat template -> {run.prepared}"]


def plan_train(recipe: Recipe, workdir: Path) -> list[str]:
    hs, lines = recipe.hidden_states, []
    if hs.mode == "online" and not hs.endpoint:  # train starts the extraction server itself
        from dspark_kit.engines.servers import server_plan

        plan = server_plan(Resolved(recipe, workdir, planning=True), "hidden-states",
                           port=recipe.serve.hidden_states_port)
        lines = ["# hidden-state server train starts (online mode)", plan.shell_line()]
    return [*lines, *train_dry_run(recipe, workdir)]


def run_eval(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.stages.evaluate import stage_eval

    return stage_eval(recipe, workdir)


def plan_eval(recipe: Recipe, workdir: Path) -> list[str]:
    return [f"# in-process: offline acceptance of {recipe.serve.checkpoint} -> {RunDir.at(workdir).eval}"]


def run_serve(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.stages.serve import stage_serve_check

    return stage_serve_check(recipe, workdir)


def plan_serve(recipe: Recipe, workdir: Path) -> list[str]:
    return _spec_server_dry_run(recipe, workdir, "serve check")


def run_bench(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.stages.bench import stage_bench

    return stage_bench(recipe, workdir)


def plan_bench(recipe: Recipe, workdir: Path) -> list[str]:
    return [*_spec_server_dry_run(recipe, workdir, "bench"),
            f"# in-process: benchmark that server -> {RunDir.at(workdir).bench}"]


def run_report(recipe: Recipe, workdir: Path) -> dict:
    from dspark_kit.stages.report import stage_report

    return stage_report(recipe, workdir)


def plan_report(recipe: Recipe, workdir: Path) -> list[str]:
    return [f"# in-process: report -> {RunDir.at(workdir).report_md}"]


REGISTRY: dict[str, Stage] = {
    s.name: s
    for s in [
        Stage("regen", ("verifier", "data", "regen"), stage_regen, plan_regen, "written"),
        Stage("prepare", ("verifier", "data"), stage_prepare, plan_prepare, "rows_out"),
        Stage("hidden-states", ("verifier", "hidden_states"), stage_hidden_states, hidden_states_dry_run,
              "generated"),
        Stage("train", ("draft", "train", "hidden_states"), stage_train, plan_train, "accept_len_epoch"),
        Stage("eval", ("eval", "serve"), run_eval, plan_eval, "acceptance_length"),
        Stage("serve", ("serve",), run_serve, plan_serve, "engine"),
        Stage("bench", ("bench", "serve"), run_bench, plan_bench, "acceptance_length"),
        Stage("report", (), run_report, plan_report, "path"),
    ]
}
STAGES = list(REGISTRY)  # pipeline order
