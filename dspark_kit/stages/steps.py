"""The eight stages, each with the same small interface: `run(res, reporter)` does the work
(showing its progress and notes through `reporter`: `run`'s stage line, or a stage command's
console) and returns a summary dict with one key figure, `plan(res)` returns what it would launch (the exact
commands, or a note for in-process work) for `--dry-run`. `res` is the command's one
`Resolved` (recipe, run folder and every derived value). `REGISTRY` is the one list the
pipeline, `run --dry-run` and every stage command use."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.resolved import Resolved


@dataclass(frozen=True)
class Stage:
    name: str
    sections: tuple[str, ...]  # recipe sections whose change invalidates the stage
    run: Callable[[Resolved, Reporter], dict]  # do it; a summary dict
    plan: Callable[[Resolved], list[str]]  # what it would launch (dry run)
    key: str  # summary field shown in the final table


def stage_regen(res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.regen import failure_verdict, run_regen

    note = reporter.note
    with reporter.bar("regen", total=res.recipe.data.limit, unit="row") as bar:
        s = run_regen(res, res.run.regen_jsonl, resume=True, on_row=lambda _row: bar.advance(),
                      engine_log=res.run.server_log("chat"))
    note(f"regen: {s['written']} written, {s['failed']} failed, {s['not_attempted']} not attempted, "
         f"{s['skipped_already_done']} already done, {sum(s['skipped_rows'].values())} unusable "
         f"of {s['source_rows']} source rows")
    for reason, n in {**s["failed_reasons"], **s["skipped_rows"]}.items():
        note(f"  {n}: {reason}")
    verdict = failure_verdict(s, res.recipe.regen.max_failed_fraction)
    if verdict:
        raise RuntimeError(verdict)
    return s


def stage_prepare(res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.prepare import prepare
    from dspark_kit.stages.prepare_input import prepare_input_rows

    recipe = res.recipe
    rows, total, unusable, source = prepare_input_rows(res)
    s = prepare(
        rows, res.verifier_path, res.run.prepared,
        seq_length=recipe.data.seq_length, thinking=recipe.verifier.thinking,
        num_workers=recipe.data.num_workers, seed=recipe.train.seed,
        trust_remote_code=recipe.verifier.trust_remote_code, total=total,
        keep_truncated=recipe.data.keep_truncated, pre_rejected=unusable,
        meta={"verifier": recipe.verifier.path, "source": source}, reporter=reporter,
    )
    return s.as_dict()


def stage_hidden_states(res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    recipe = res.recipe
    if recipe.hidden_states.mode == "online":
        return {"skipped": "hidden_states.mode is online: the trainer asks a server"}
    if recipe.hidden_states.backend != "local":
        from dspark_kit.stages.hidden_states_vllm import run_offline_vllm

        return run_offline_vllm(res, reporter)
    from dspark_kit.stages.hidden_states import generate_offline

    s = generate_offline(
        res.run.prepared, res.verifier_path, res.exported_layer_ids, device=res.train_device.value,
        dtype=res.hidden_states_dtype.value, out_dtype=res.hidden_states_out_dtype.value,
        trust_remote_code=recipe.verifier.trust_remote_code, reporter=reporter,
    )
    return s.as_dict()


def train_args(res: Resolved, hidden_states_endpoint: str | None = None) -> tuple[list[str], str]:
    """speculators train flags for this recipe, and the device they are for (Resolved.train_device:
    a plan keeps an explicit train.device even when this machine lacks it)."""
    from dspark_kit.stages.train import build_train_args

    device = res.train_device.value
    args = build_train_args(res.recipe, res.run.root, verifier_path=res.verifier_path, device=device,
                            num_hidden_layers=res.num_hidden_layers, hidden_states_endpoint=hidden_states_endpoint,
                            mooncake=res.mooncake)
    return args, device


def train_plan(res: Resolved, hidden_states_endpoint: str | None = None):
    from dspark_kit.stages.train import launch_plan

    args, device = train_args(res, hidden_states_endpoint)
    plan = launch_plan(res.recipe, args, device)
    if res.mooncake is not None and res.recipe.hidden_states.mode == "online":
        plan.env.update(res.mooncake.env())  # the address this node's trainer joins the store as
    return plan


def stage_train(res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.manifest import update_manifest
    from dspark_kit.stages.preflight import enforce
    from dspark_kit.stages.train import (
        read_val_metrics,
        run_training,
        set_aside_incomplete_checkpoints,
        training_failure,
    )

    recipe, run = res.recipe, res.run
    enforce(res, "train", log=reporter.note)
    for d in set_aside_incomplete_checkpoints(run.checkpoints):
        reporter.note(f"train: {d.name} was cut off mid-save by an earlier run; kept aside, resuming from the last whole epoch")
    t0 = time.time()
    from contextlib import ExitStack

    with ExitStack() as stack:
        endpoint = None  # offline: the trainer reads prepared/hidden_states
        if recipe.hidden_states.mode == "online":
            from dspark_kit.engines.servers import hidden_state_server, mooncake_master

            stack.enter_context(mooncake_master(res))  # before the server that joins it (transport mooncake)
            endpoint = stack.enter_context(hidden_state_server(res))
        plan = train_plan(res, endpoint.url if endpoint else None)
        update_manifest(run.root, recipe, "train", resolved=res, argv=plan.argv, env=plan.env)
        run.logs.mkdir(parents=True, exist_ok=True)
        log = run.train_log
        since = log.stat().st_size if log.exists() else 0
        code, gone = run_training(plan, log, watch=endpoint.gone if endpoint else None, reporter=reporter)
    res.checkpoints_changed()
    if gone:
        raise RuntimeError(f"{gone}; training stopped. Rerun the same command to resume from the last whole epoch")
    if code != 0:
        raise RuntimeError(training_failure(code, log, since, endpoint.url if endpoint else None))
    metrics = read_val_metrics(run.checkpoints) or {}
    return {"seconds": round(time.time() - t0, 1), **metrics}


# ---- dry runs: each stage's commands, what `<stage> --dry-run` prints ------------


def hidden_states_dry_run(res: Resolved) -> list[str]:
    """The bytes offline files take (or would), what each node needs for hidden states, and the
    commands backend vllm would launch."""
    from dspark_kit.stages.storage_plan import plan_lines

    return [*plan_lines(res), *_hidden_states_commands(res)]


def _hidden_states_commands(res: Resolved) -> list[str]:
    from dspark_kit.stages.hidden_states_vllm import dry_run_lines, node_notes

    hs = res.recipe.hidden_states
    if hs.backend == "local" and hs.mode == "offline":
        return [*node_notes(res), (f"# nothing to launch: hidden_states backend=local runs in-process on "
                                   f"{res.train_device.value} in {res.hidden_states_dtype.value} (once; every node "
                                   "reads DIR/prepared/hidden_states)")]
    if hs.mode == "online" and hs.backend == "local":
        return ["# online, backend local: `dspark-kit train` starts the kit's own extraction server on each node"]
    return dry_run_lines(res)


def train_dry_run(res: Resolved) -> list[str]:
    """The exact training command(s), one per node with the rendezvous decision (raises
    RecipeError/RuntimeError when unplannable)."""
    from dspark_kit.rendezvous import rendezvous_for
    from dspark_kit.stages.train import node_plans

    recipe, hs = res.recipe, res.recipe.hidden_states
    endpoint = hs.endpoint or (f"http://{recipe.serve.host}:{recipe.serve.hidden_states_port}"
                               if hs.mode == "online" else None)
    args, device = train_args(res, endpoint)
    rdzv = rendezvous_for(recipe, device)
    plans = node_plans(recipe, args, device, rdzv)
    if len(plans) == 1:
        return [plans[0].shell_line()]
    lines = [f"# {rdzv.summary()}", *(f"# warning: {w}" for w in rdzv.warnings)]
    if rdzv.backend == "c10d":
        lines.append("# c10d assigns node ranks at rendezvous: every node runs the same command; "
                     "`dspark-kit train` on each node resolves that node's own interface")
    return lines + [line for i, p in enumerate(plans) for line in (f"# node {i}", p.shell_line())]


def _spec_server_dry_run(res: Resolved, what: str) -> list[str]:
    from dspark_kit.stages.serve import ServeError, plan_server

    try:
        sp = plan_server(res, "spec")
    except (ServeError, ValueError, OSError) as e:
        return [f"# {what}: cannot plan the spec server ({e})"]
    return [f"# {what}: spec server on checkpoint {sp.resolved.checkpoint}", sp.plan.shell_line(),
            *(f"# note: {n}" for n in sp.warnings)]


def plan_regen(res: Resolved) -> list[str]:
    if not res.recipe.regen.enabled:
        return ["# regen disabled (regen.enabled: false)"]
    from dspark_kit.stages.regen import regen_plan, regen_plan_lines

    return regen_plan_lines(regen_plan(res, outfile=res.run.regen_jsonl))


def plan_prepare(res: Resolved) -> list[str]:
    recipe, run = res.recipe, res.run
    src = run.regen_jsonl if recipe.regen.enabled else recipe.data.source
    return [f"# in-process: tokenize {src} with {recipe.verifier.path}'s chat template -> {run.prepared}"]


def plan_train(res: Resolved) -> list[str]:
    hs, lines = res.recipe.hidden_states, []
    if hs.mode == "online" and not hs.endpoint:  # train starts the extraction server itself
        from dspark_kit.engines.servers import server_plan

        plan = server_plan(res, "hidden-states", port=res.recipe.serve.hidden_states_port)
        lines = ["# hidden-state server train starts (online mode)", plan.shell_line()]
        if res.mooncake is not None:
            from dspark_kit.engines import shell_line

            lines = [*res.mooncake.node_lines(), "# mooncake master (node 0)",
                     shell_line(res.mooncake.master_argv(), {}), *lines]
    return [*lines, *train_dry_run(res)]


def run_eval(res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    """In-process when the verifier fits the eval device, else through the serving engine (Resolved.eval_mode)."""
    if res.eval_mode.value == "served":
        from dspark_kit.stages.served_tune import served_eval

        s = served_eval(res)
        return {k: s[k] for k in ("acceptance_length", "per_position_acceptance", "tokens_per_verifier_forward")}
    from dspark_kit.stages.evaluate import stage_eval

    return stage_eval(res)


def plan_eval(res: Resolved) -> list[str]:
    from dspark_kit.stages.heldout import plan_line

    mode, where = res.eval_mode, f"{plan_line(res)} -> {res.run.eval}"
    device = f"{res.eval_device.value} ({res.eval_dtype.value})"
    if mode.value == "served":
        return [(f"# served: acceptance through the {res.engine} engine at the bench concurrency, {where} "
                f"(why: {mode.source})"), *_spec_server_dry_run(res, "eval")]
    if res.eval_fit.value is None:  # cannot tell on this machine: the run decides
        return [(f"# decided when it runs: in-process on {device} if the verifier fits there, else served through "
                f"the {res.engine} engine (the server below); {where}; {res.eval_fit.source}"),
                *_spec_server_dry_run(res, "eval if served")]
    return [f"# in-process: offline acceptance on {device}, {where} (why: {mode.source})"]


def run_serve(res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.serve import stage_serve_check

    return stage_serve_check(res)


def plan_serve(res: Resolved) -> list[str]:
    return _spec_server_dry_run(res, "serve check")


def run_bench(res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.bench import stage_bench

    return stage_bench(res)


def plan_bench(res: Resolved) -> list[str]:
    return [*_spec_server_dry_run(res, "bench"), f"# in-process: benchmark that server -> {res.run.bench}"]


def run_report(res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.report import stage_report

    return stage_report(res.recipe, res.run.root)


def plan_report(res: Resolved) -> list[str]:
    return [f"# in-process: report -> {res.run.report_md}"]


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
