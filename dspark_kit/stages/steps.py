"""The eight stages, each with the same small interface: `plan(res)` returns the stage's typed
plan (stages/plan.py: every process it starts, the paths, the decided values), which `--dry-run`
prints; `run(res, plan, reporter)` executes exactly that plan (showing progress and notes through
`reporter`: `run`'s stage line, or a stage command's console) and returns a summary dict with one
key figure; `execute` does both and records the plan in the run folder. `res` is the command's one
`Resolved` (recipe, run folder and every derived value). `REGISTRY` is the one list the
pipeline, `run --dry-run` and every stage command use."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.resolved import Resolved
from dspark_kit.stages.plan import DECIDED, Process, StagePlan


@dataclass(frozen=True)
class Stage:
    name: str
    sections: tuple[str, ...]  # recipe sections whose change invalidates the stage
    run: Callable[[Resolved, StagePlan, Reporter], dict]  # execute the plan; a summary dict
    plan: Callable[[Resolved], StagePlan]  # what it will do (dry run, and the plan a run executes)
    key: str  # summary field shown in the final table


def execute(stage: Stage, res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    """Plan the stage, record the plan in the run folder, run exactly that plan."""
    plan = stage.plan(res)
    plan.record(res.run.plan_file(stage.name))
    return stage.run(res, plan, reporter)


def _plan(res: Resolved, stage: str, lines: list[str], processes: list[Process] | None = None,
          inputs: dict | None = None, outputs: dict | None = None) -> StagePlan:
    return StagePlan(stage, lines, processes or [], inputs or {}, outputs or {}, decisions=res.summary(DECIDED[stage]))


def stage_regen(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.dataset.regen import failure_verdict, mode_line, run_regen, tools_line

    note = reporter.note
    chat = plan.process("chat server")
    with reporter.bar("regen", total=res.recipe.data.limit, unit="row") as bar:
        s = run_regen(res, res.run.regen_jsonl, resume=True, on_row=lambda _row: bar.advance(),
                      engine_log=res.run.server_log("chat"), server_plan=chat.server if chat else None)
    note(f"regen: {s['written']} written, {s['failed']} failed, {s['not_attempted']} not attempted, "
         f"{s['skipped_already_done']} already done, {sum(s['skipped_rows'].values())} unusable "
         f"of {s['source_rows']} source rows")
    for reason, n in {**s["failed_reasons"], **s["skipped_rows"]}.items():
        note(f"  {n}: {reason}")
    for line in (tools_line(s), mode_line(s)):
        if line:
            note(f"  {line}")
    verdict = failure_verdict(s, res.recipe.regen.max_failed_fraction, res.recipe.data.max_mode_mismatch_fraction)
    if verdict:
        raise RuntimeError(verdict)
    return s


def plan_regen(res: Resolved) -> StagePlan:
    if not res.recipe.regen.enabled:
        return _plan(res, "regen", ["# regen disabled (regen.enabled: false)"])
    import os

    from dspark_kit.stages.dataset.regen import regen_plan

    # the key a run would take from the environment, so the dry run shows the same (masked) env
    return regen_plan(res, outfile=res.run.regen_jsonl, api_key=os.environ.get("DSPARK_KIT_API_KEY"))


def plan_prepare(res: Resolved) -> StagePlan:
    from dspark_kit.stages.dataset.prepare_input import prepare_source

    src, out = prepare_source(res), res.run.prepared
    return _plan(res, "prepare", [f"# in-process: tokenize {src} with {res.recipe.verifier.path}'s chat template -> {out}"],
                 inputs={"rows": src, "verifier": res.recipe.verifier.path}, outputs={"prepared": str(out)})


def stage_prepare(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.dataset.prepare import prepare
    from dspark_kit.stages.dataset.prepare_input import prepare_input_rows

    recipe = res.recipe
    rows, total, unusable, source = prepare_input_rows(res)
    s = prepare(
        rows, res.verifier_path, plan.outputs["prepared"],
        seq_length=recipe.data.seq_length, thinking=recipe.verifier.thinking,
        num_workers=recipe.data.num_workers, seed=recipe.train.seed,
        trust_remote_code=recipe.verifier.trust_remote_code, total=total,
        keep_truncated=recipe.data.keep_truncated, pre_rejected=unusable,
        meta={"verifier": recipe.verifier.path, "source": source}, reporter=reporter, mixture_seed=recipe.mixture_seed,
        mode_budget=recipe.data.max_mode_mismatch_fraction,
    )
    return s.as_dict()


def plan_hidden_states(res: Resolved) -> StagePlan:
    """The bytes offline files take (or would), what each node needs for hidden states, and the
    processes backend vllm starts."""
    from dspark_kit.stages.hidden.storage_plan import plan_lines

    hs, lines, processes = res.recipe.hidden_states, plan_lines(res), []
    outputs = {"hidden_states": str(res.run.hidden_states)} if hs.mode == "offline" else {}
    inputs = {"prepared": str(res.run.prepared), "verifier": res.verifier_path}
    if hs.backend == "local" and hs.mode == "offline":
        from dspark_kit.stages.hidden.hidden_states_vllm import node_notes

        lines += [*node_notes(res), (f"# nothing to launch: hidden_states backend=local runs in-process on "
                                     f"{res.train_device.value} in {res.hidden_states_dtype.value} (once; every "
                                     "node reads DIR/prepared/hidden_states)")]
    elif hs.mode == "online" and hs.backend == "local":
        lines.append("# online, backend local: `dspark-kit train` starts the kit's own extraction server on each node")
    else:
        from dspark_kit.stages.hidden.hidden_states_vllm import offline_processes

        more, processes = offline_processes(res)
        lines += more
    return _plan(res, "hidden-states", lines, processes, inputs, outputs)


def stage_hidden_states(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    recipe = res.recipe
    if recipe.hidden_states.mode == "online":
        return {"skipped": "hidden_states.mode is online: the trainer asks a server"}
    if recipe.hidden_states.backend != "local":
        from dspark_kit.stages.hidden.hidden_states_vllm import run_offline_vllm

        return run_offline_vllm(res, plan, reporter)
    from dspark_kit.stages.hidden.hidden_states import generate_offline

    s = generate_offline(
        res.run.prepared, res.verifier_path, res.exported_layer_ids, device=res.train_device.value,
        dtype=res.hidden_states_dtype.value, out_dtype=res.hidden_states_out_dtype.value,
        trust_remote_code=recipe.verifier.trust_remote_code, reporter=reporter,
    )
    return s.as_dict()


def plan_train(res: Resolved) -> StagePlan:
    """The hidden-state server and Mooncake master train starts (online mode), and the exact
    training command(s), one per node with the rendezvous decision (raises RecipeError or
    RuntimeError when unplannable)."""
    from dspark_kit.distributed.rendezvous import rendezvous_for
    from dspark_kit.engines import shell_line
    from dspark_kit.stages.training.train import build_train_args, node_plans

    recipe, hs = res.recipe, res.recipe.hidden_states
    lines: list[str] = []
    processes: list[Process] = []
    endpoint = hs.endpoint
    if hs.mode == "online" and not hs.endpoint:  # train starts the extraction server itself
        from dspark_kit.engines.servers import server_plan

        server = server_plan(res, "hidden-states")
        endpoint = server.base_url
        if res.mooncake is not None:
            from dspark_kit.engines.servers import mooncake_master_plan

            mc = res.mooncake
            master = mooncake_master_plan(mc)
            if mc.start_on_node == recipe.train.node_rank:
                processes.append(Process("mooncake master", master))
            lines += [*mc.node_lines(), "# mooncake master (node 0)", shell_line(master.argv, {})]
        processes.append(Process("hidden-state server", server))
        lines += ["# hidden-state server train starts (online mode)", server.shell_line()]
    device = res.train_device.value
    args = build_train_args(recipe, res.run.root, verifier_path=res.verifier_path, device=device,
                            hidden_states_dtype=res.hidden_states_out_dtype.value,
                            num_hidden_layers=res.num_hidden_layers, hidden_states_endpoint=endpoint,
                            mooncake=res.mooncake)
    rdzv = rendezvous_for(recipe, device)
    trainers = node_plans(recipe, args, device, rdzv)
    if res.mooncake is not None and hs.mode == "online":
        for t in trainers:
            t.env.update(res.mooncake.env())  # the address this node's trainer joins the store as
    processes += [Process("trainer", t, node=i) for i, t in enumerate(trainers)]
    from dspark_kit.resolved.memory_plan import plan_lines as memory_lines

    lines += memory_lines(res)  # before the command(s): a dry run's last line stays the trainer's
    if len(trainers) == 1:
        lines.append(trainers[0].shell_line())
    else:
        lines += [f"# {rdzv.summary()}", *(f"# warning: {w}" for w in rdzv.warnings)]
        lines.append("# on node K run `dspark-kit train --set train.node_rank=K` (or its line below): it resolves "
                     "that node's own interface" + (" and address (--local-addr); node 0 hosts the c10d store"
                                                    if rdzv.backend == "c10d" else ""))
        here = "" if rdzv.same_host else " (this machine)"
        lines += [line for i, t in enumerate(trainers)
                  for line in (f"# node {i}{here if i == rdzv.this_rank else ''}", t.shell_line())]
    inputs = {"prepared": str(res.run.prepared), "verifier": res.verifier_path}
    if hs.mode == "offline":
        inputs["hidden_states"] = str(res.run.hidden_states)
    elif endpoint:
        inputs["hidden_states_endpoint"] = endpoint
    return _plan(res, "train", lines, processes, inputs, {"checkpoints": str(res.run.checkpoints)})


def stage_train(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    from contextlib import ExitStack

    from dspark_kit.distributed.rendezvous import (
        MasterWatch,
        rendezvous_for,
        store_failure,
        wait_for_store,
    )
    from dspark_kit.logs import log_since
    from dspark_kit.specdec.checkpoints import adopt_interrupted
    from dspark_kit.stages.manifest import update_manifest
    from dspark_kit.stages.preflight.checks import enforce
    from dspark_kit.stages.training.train import (
        read_val_metrics,
        run_training,
        set_aside_incomplete_checkpoints,
        training_failure,
    )

    recipe, run = res.recipe, res.run
    enforce(res, "train", log=reporter.note)
    for d in set_aside_incomplete_checkpoints(run.checkpoints):
        reporter.note(f"train: {d.name} was cut off mid-save by an earlier run; kept aside, resuming from the last whole epoch")
    if (adopted := adopt_interrupted(run.checkpoints)) is not None:
        reporter.note(f"train: {adopted}")
    t0 = time.time()
    trainer = next(p for p in plan.processes if p.role == "trainer" and p.node == recipe.train.node_rank).launch
    rdzv = rendezvous_for(recipe, res.train_device.value) if recipe.train.nnodes > 1 else None
    if rdzv is not None:
        wait_for_store(rdzv)  # node K > 0: node 0's store answers within rdzv_timeout, else one line
    with ExitStack() as stack:
        endpoint = None  # offline: nothing to watch
        master, server = plan.process("mooncake master"), plan.process("hidden-state server")
        if master is not None:  # before the server that joins it (transport mooncake)
            from dspark_kit.engines.servers import started

            stack.enter_context(started(master.server, run.mooncake_log, recipe.serve.startup_timeout))
        if server is not None or (recipe.hidden_states.mode == "online" and recipe.hidden_states.endpoint):
            from dspark_kit.engines.servers import hidden_state_server

            # the one started here, or the recipe's endpoint: both watched while training uses them
            endpoint = stack.enter_context(hidden_state_server(res, server.server if server else None))
        update_manifest(run.root, recipe, "train", resolved=res, argv=trainer.argv, env=trainer.env)
        run.logs.mkdir(parents=True, exist_ok=True)
        log = run.train_log
        since = log.stat().st_size if log.exists() else 0
        store = MasterWatch(rdzv) if rdzv is not None else None  # node 0's rendezvous store, from node K
        watches = [w for w in (endpoint.gone if endpoint else None, store.gone if store and store.active else None)
                   if w is not None]
        code, gone = run_training(trainer, log, watch=_first_reason(watches) if watches else None, reporter=reporter)
    res.checkpoints_changed()
    if gone and store is not None and store.silent_since is not None:
        raise RuntimeError(gone)  # names the lost master and the fix
    if gone:
        raise RuntimeError(f"{gone}; training stopped. Rerun the same command to resume (from the checkpoint "
                           "speculators saves when stopped, else the last whole epoch)")
    if code != 0:
        lost = store_failure(log_since(log, since), rdzv) if rdzv is not None else None
        raise RuntimeError(lost or training_failure(code, log, since, endpoint.url if endpoint else None))
    metrics = read_val_metrics(run.checkpoints) or {}
    return {"seconds": round(time.time() - t0, 1), **metrics}


def _first_reason(watches):
    """One watch from several: the first reason any of them gives."""
    return lambda: next((why for w in watches if (why := w()) is not None), None)


def _spec_server(res: Resolved, what: str) -> tuple[list[str], list[Process]]:
    from dspark_kit.stages.serving.serve import ServeError, plan_server

    try:
        sp = plan_server(res, "spec")
    except (ServeError, ValueError, OSError) as e:
        return [f"# {what}: cannot plan the spec server ({e})"], []
    return ([f"# {what}: spec server on checkpoint {sp.resolved.checkpoint}", sp.plan.shell_line(),
             *(f"# note: {n}" for n in sp.warnings)], [Process("spec server", sp.plan)])


def plan_eval(res: Resolved) -> StagePlan:
    """In-process when the verifier fits the eval device, else through the serving engine (Resolved.eval_mode)."""
    from dspark_kit.stages.evaluation.heldout import plan_line

    t = res.recipe.measured_temperature
    at = "greedy" if t == 0 else f"sampled at temperature {t:g} (eval.temperature)"
    mode, where = res.eval_mode, f"{plan_line(res)}, {at} -> {res.run.eval}"
    device = f"{res.eval_device.value} ({res.eval_dtype.value})"
    outputs = {"eval": str(res.run.eval_json)}
    if mode.value == "served":  # the server is sized at start for the longest eval prompt (its max_model_len)
        lines, _ = _spec_server(res, "eval")
        plan = _plan(res, "eval", [(f"# served: acceptance through the {res.engine} engine at the bench "
                                    f"concurrency, {where} (why: {mode.source})"), *lines], outputs=outputs)
        plan.details["server"] = "chosen at start: a spec server with room for the longest eval prompt"
        return plan
    if res.eval_fit.value is None:  # cannot tell on this machine: the run decides
        lines, _ = _spec_server(res, "eval if served")
        return _plan(res, "eval", [(f"# decided when it runs: in-process on {device} if the verifier fits there, else "
                                    f"served through the {res.engine} engine (the server below); {where}; "
                                    f"{res.eval_fit.source}"), *lines], outputs=outputs)
    return _plan(res, "eval", [f"# in-process: offline acceptance on {device}, {where} (why: {mode.source})"],
                 outputs=outputs)


@contextlib.contextmanager
def _doing(reporter: Reporter, stage: str, what: str) -> Iterator[None]:
    """A stage with no count of its own: its line says what it is doing (the heartbeat repeats it)."""
    with reporter.bar(stage, None) as bar:
        bar.describe(what)
        yield


def run_eval(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    if res.eval_mode.value == "served":
        from dspark_kit.stages.evaluation.served_tune import served_eval

        with _doing(reporter, "eval", "served: starting the spec server, then timing the eval prompts"):
            s = served_eval(res)
        return {k: s[k] for k in ("acceptance_length", "per_position_acceptance", "tokens_per_verifier_forward")}
    from dspark_kit.stages.evaluation.evaluate import stage_eval

    with _doing(reporter, "eval", f"in-process: loading the verifier and draft, then decoding "
                                  f"{res.recipe.eval.num_prompts} prompts with speculation"):
        return stage_eval(res)


def plan_serve(res: Resolved) -> StagePlan:
    lines, procs = _spec_server(res, "serve check")
    if res.engine != "local":  # nothing starts here: the command is written for the serving host
        lines.append(f"# written to {res.run.serve_command}; a non-local engine is not started by the serve check")
        procs = []
    return _plan(res, "serve", lines, procs, outputs={"command": str(res.run.serve_command)})


def run_serve(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.serving.serve import stage_serve_check

    spec = plan.process("spec server")
    with _doing(reporter, "serve", "starting the spec server and checking that it answers"):
        return stage_serve_check(res, spec.server if spec else None)


def plan_bench(res: Resolved) -> StagePlan:
    lines, procs = _spec_server(res, "bench")
    at = f"temperature {res.recipe.measured_temperature:g}"
    return _plan(res, "bench", [*lines, f"# in-process: benchmark that server at {at} -> {res.run.bench}"], procs,
                 outputs={"bench": str(res.run.bench)})


def run_bench(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.serving.bench import stage_bench

    spec = plan.process("spec server")
    with _doing(reporter, "bench", "starting the spec server, then benchmarking it"):
        return stage_bench(res, spec.server if spec else None)


def plan_report(res: Resolved) -> StagePlan:
    return _plan(res, "report", [f"# in-process: report -> {res.run.report_md}"],
                 outputs={"report": str(res.run.report_md)})


def run_report(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    from dspark_kit.stages.reporting.report import stage_report

    return stage_report(res.recipe, res.run.root)


REGISTRY: dict[str, Stage] = {
    s.name: s
    for s in [
        Stage("regen", ("verifier", "data", "regen"), stage_regen, plan_regen, "written"),
        # regen: what prepare reads (regen.enabled) and the seed of a thinking mixture's draw
        Stage("prepare", ("verifier", "data", "regen"), stage_prepare, plan_prepare, "rows_out"),
        Stage("hidden-states", ("verifier", "hidden_states"), stage_hidden_states, plan_hidden_states, "generated"),
        Stage("train", ("draft", "train", "hidden_states"), stage_train, plan_train, "accept_len_epoch"),
        Stage("eval", ("eval", "serve"), run_eval, plan_eval, "acceptance_length"),
        Stage("serve", ("serve",), run_serve, plan_serve, "engine"),
        Stage("bench", ("bench", "serve", "eval"), run_bench, plan_bench, "acceptance_length"),  # eval: the mode measured
        Stage("report", (), run_report, plan_report, "path"),
    ]
}
STAGES = list(REGISTRY)  # pipeline order


def run_stage(name: str, res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    """One stage by name, as `run` and the stage commands do it (plan, record, execute)."""
    return execute(REGISTRY[name], res, reporter)
