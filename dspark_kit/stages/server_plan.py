"""A server's plan for a role, checked first: what `dspark-kit serve`, the serve check, bench and a
served eval start.

`checked_server` checks the role and engine, resolves the spec checkpoint and judges it by the
resolver's one checkpoint check, runs the whole-recipe preflight, then asks the engine for its
plan. `spec_server_lines` is that plan as the lines a stage's dry run prints.

The engines take plain values: `server_plan` asks the resolver once for what a role's plan reads
(`serve_inputs`: engines/serve_inputs.ServeInputs) and hands it to engines/servers.py; the servers
a stage starts (`managed_server`, `running_server`, `hidden_state_server`) get their plan, log and
start-up timeout here.

A floor of stages/ above preflight/ and below the stage folders: it may import stages/plan.py,
stages/preflight/ and the layers below, never a stage folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dspark_kit.engines import ServerPlan
from dspark_kit.engines.ports import Port, decide_port
from dspark_kit.engines.serve_inputs import ServeInputs, SpecInputs
from dspark_kit.recipe import ROLES
from dspark_kit.resolved import Resolved
from dspark_kit.stages.plan import Process

if TYPE_CHECKING:
    from dspark_kit.engines.lifecycle import ManagedServer
    from dspark_kit.engines.servers import HiddenStateEndpoint


class ServeError(ValueError):
    """One line naming the setting (or checkpoint finding) and the fix."""


@dataclass
class CheckedServer:
    """A role's server once checked: the engine's launch plan (`plan`, an engines.ServerPlan) with
    what the checks found and warned, and the mooncake master it needs first."""

    plan: ServerPlan
    resolved: Resolved
    findings: list = field(default_factory=list)  # checkpoint findings (spec)
    warnings: list[str] = field(default_factory=list)  # checkpoint + preflight warnings, plan notes
    mooncake_master: ServerPlan | None = None  # role hidden-states, transport mooncake: started first

    @property
    def decisions(self) -> list[str]:
        """What the plan decided and why (engine gate, K, window, adaptive verification): not warnings."""
        return self.plan.decisions


def checked_server(res: Resolved, role: str, *, port: int | None = None, api_key: str | None = None) -> CheckedServer:
    """`res` carries the command's --engine and --checkpoint (and planning for --dry-run); the
    checks below and the preflight all judge that one resolution."""
    from dspark_kit.specdec.checkpoints import CheckpointError, errors
    from dspark_kit.stages.preflight.checks import PreflightError, enforce, label

    if role not in ROLES:
        raise ServeError(f"--role {role!r}: expected one of {', '.join(ROLES)}")
    if res.checkpoint_choice is not None and role != "spec":
        raise ServeError(f"--checkpoint: only role spec loads a draft (got --role {role})")
    if res.engine == "vllm":  # before the checkpoint checks: vLLM's CPU build has no role spec
        from dspark_kit.engines.vllm import cpu_refusal

        refused = cpu_refusal(res.vllm_on_cpu, role)
        if refused:
            raise ServeError(refused)
    findings, warnings, preflight = [], [], []
    if role == "spec":
        try:
            exists = res.checkpoint_exists
        except CheckpointError as e:
            raise ServeError(str(e)) from None
        if exists:
            findings = res.checkpoint_findings()
            bad = errors(findings)
            if bad:
                raise ServeError("; ".join(f"{f.code}: {f.message}" for f in bad))
            warnings += [f"{f.code}: {f.message}" for f in findings]
            try:  # the whole-recipe pitfalls; the checkpoint's own were judged just above
                preflight = enforce(res, "serve", log=lambda _line: None, checkpoint_checked=True)
            except PreflightError as e:
                raise ServeError(str(e)) from None
    try:
        plan = server_plan(res, role, port=port, api_key=api_key)
    except ValueError as e:
        raise ServeError(str(e)) from None
    # each warning once: a window risk is both a plan note and a preflight finding
    warnings += [f"preflight warning ({label(f)}): {f.message}" for f in preflight
                 if f.level == "warning" and f.message not in plan.notes]
    master = None
    mc = res.mooncake
    if role == "hidden-states" and mc is not None and mc.start_on_node == res.recipe.train.node_rank:
        from dspark_kit.engines.servers import mooncake_master_plan

        master = mooncake_master_plan(mc)  # the store the server joins: this host runs its master
    return CheckedServer(plan, res, findings, warnings + plan.notes, master)


def spec_server_lines(res: Resolved, what: str) -> tuple[list[str], list[Process]]:
    """The spec server a stage starts, as dry-run lines and its one process; a spec server that
    cannot be planned yet (no checkpoint before train) is a note, not an error."""
    try:
        sp = checked_server(res, "spec")
    except (ServeError, ValueError, OSError) as e:
        return [f"# {what}: cannot plan the spec server ({e})"], []
    return ([f"# {what}: spec server on checkpoint {sp.resolved.checkpoint}", sp.plan.shell_line(),
             *(f"# note: {n}" for n in sp.warnings)], [Process("spec server", sp.plan)])


# ---- what an engine's plan reads, asked of the resolver once ---------------------------------


def server_plan(res: Resolved, role: str, port: int | Port | None = None, api_key: str | None = None,
                host: str | None = None, extra_args: list[str] | None = None) -> ServerPlan:
    """The plan for `role` on the resolver's engine (default: the recipe's serve.engine).

    port: None = the recipe's port for the role (engines/ports.py decides, 0 = a free one now).
    api_key goes to the server in its environment, never argv; `host` replaces serve.host (a server
    other machines reach binds 0.0.0.0)."""
    from dspark_kit.engines import servers

    decided = decide_port(res.recipe.serve, role, host) if port is None else port
    number = decided.number if isinstance(decided, Port) else int(decided)
    return servers.server_plan(serve_inputs(res, role, number, host), role, decided, api_key=api_key,
                               host=host, extra_args=extra_args)


def serve_inputs(res: Resolved, role: str, port: int, host: str | None = None) -> ServeInputs:
    """What `role`'s plan on res.engine reads, decided in the order the engine's plan reads it (a
    refusal comes before what it makes moot; nothing is built that the plan does not need)."""
    if res.engine == "llama.cpp":
        return ServeInputs(res.recipe, res.engine, llamacpp=llamacpp_serve(res, role, port, host),
                           planning=res.planning)
    if res.engine == "local":
        return ServeInputs(
            res.recipe, res.engine, res.verifier_path, tuple(res.served_names(role)), res.serve_device.value,
            res.serve_dtype.value,
            exported_layer_ids=tuple(res.exported_layer_ids) if role == "hidden-states" else (),
            hidden_states_dtype=res.hidden_states_out_dtype.value if role == "hidden-states" else None,
            spec=_spec_inputs(res) if role == "spec" else None)
    from dspark_kit.engines.vllm import check_cpu_build, check_cpu_fp8, check_plannable

    check_plannable(res.engine, role)
    on_cpu = res.vllm_on_cpu
    hs_dtype = None
    if on_cpu:  # the CPU build's refusals first, as its plan makes them
        python = check_cpu_build(role)
        hs_dtype = res.hidden_states_out_dtype.value if role == "hidden-states" else None
        check_cpu_fp8(role, hs_dtype, python)
    verifier, names = res.verifier_path, tuple(res.served_names(role))
    layers, mooncake = (tuple(res.exported_layer_ids), res.mooncake) if role == "hidden-states" else ((), None)
    if role == "hidden-states" and hs_dtype is None:
        hs_dtype = res.hidden_states_out_dtype.value
    spec = _spec_inputs(res, vllm=True) if role == "spec" else None
    return ServeInputs(res.recipe, res.engine, verifier, names, res.serve_device.value, res.serve_dtype.value,
                       on_cpu=on_cpu, exported_layer_ids=layers, hidden_states_dtype=hs_dtype, mooncake=mooncake,
                       spec=spec)


def _spec_inputs(res: Resolved, vllm: bool = False) -> SpecInputs:
    """Role spec: the draft and its decisions (vllm: the engine gate first, then adaptive
    verification, top-k and what the release takes)."""
    if not vllm:
        k, window = res.k, res.window
        return SpecInputs(res.checkpoint, k, window, tuple(res.spec_decision_lines()))
    from dspark_kit.engines.vllm import gate_refusal

    gate = res.engine_gate
    gate_refusal(gate.ok, gate.message)
    k, window, adaptive, topk = res.k, res.window, res.adaptive_verification, res.draft_topk
    exists = res.checkpoint_exists
    return SpecInputs(res.checkpoint, k, window, tuple(res.spec_decision_lines()), exists=exists,
                      adaptive=adaptive, topk=topk, gate_message=gate.message,
                      engine_version=res.engine_support.version, engine_features=res.engine_support.features)


def llamacpp_serve(res: Resolved, role: str, port: int, host: str | None = None):
    """engines/llamacpp.py's plain values from the resolver: the GGUF files, K, the confidence cut-off (--spec-draft-p-min), the window asked."""
    from dspark_kit.engines.llamacpp import MAX_SLOTS, LlamaCppPlanError, LlamaCppServe
    from dspark_kit.engines.servers import gguf_export_dir

    s = res.recipe.serve
    own = res.verifier_gguf  # a GGUF verifier: the file itself
    # parallel slots: what the role's client sends at once (regen's requests, bench's streams); llama.cpp's
    # -c is the KV size all slots share, so each slot gets serve.max_model_len
    slots = min(MAX_SLOTS, res.recipe.regen.concurrency if role == "chat" else res.recipe.bench.concurrency)
    common = {"role": role, "host": host or s.host, "port": port, "served_name": res.served_names(role)[0],
              "parallel": slots, "ctx_size": s.max_model_len * slots if s.max_model_len else None,
              "seed": s.seed, "extra_args": tuple(s.extra_args), "threads": s.cpu_threads}
    if role != "spec":
        if not own:
            raise LlamaCppPlanError(f"--engine llama.cpp --role {role}: llama.cpp serves GGUF files; verifier.path "
                                    f"{res.recipe.verifier.path} is not one (name a .gguf file, or serve role spec, "
                                    "whose export converts the verifier)")
        return LlamaCppServe(verifier_gguf=own, **common)
    from dspark_kit.specdec.gguf_export import DRAFT_GGUF, VERIFIER_GGUF, servable_problem

    try:
        cfg = res.checkpoint_config
    except ValueError:  # nothing trained yet: what the recipe will train
        cfg = None
    # nothing trained yet: either draft.arch the recipe allows converts (gguf_export.SPECULATORS_LAYER_CONFIGS)
    why = servable_problem(cfg, f"--engine llama.cpp: checkpoint {res.checkpoint}") if cfg else None
    if why:
        raise LlamaCppPlanError(why)
    out = gguf_export_dir(res.run.serve, res.checkpoint)
    adaptive = res.adaptive_verification
    return LlamaCppServe(verifier_gguf=own or str(out / VERIFIER_GGUF), draft_gguf=str(out / DRAFT_GGUF),
                         k=res.k.value, conf_min=res.conf_min if adaptive.value else None,
                         window=res.wanted_window.value, window_source=res.wanted_window.source,
                         decisions=(f"K {res.k.value}: {res.k.source}", f"adaptive verification: {adaptive.source}",
                                    f"draft GGUF: {out / DRAFT_GGUF} (dspark-kit export --layout gguf)"),
                         **common)


def regen_engine(res: Resolved) -> tuple[str, str]:
    """(the engine regen's chat server runs on, why): engines/servers.py's rule on regen.engine,
    serve.engine and where the local engine would run."""
    from dspark_kit.engines import servers

    choice = res.recipe.regen.engine
    device = res.train_device.value if choice == "fastest" else ""
    return servers.regen_engine(choice, res.engine, device)


def regen_server_plan(res: Resolved, api_key: str | None = None) -> ServerPlan:
    """The chat server regen starts when no endpoint is given: regen_engine's, on serve.port."""
    engine, _why = regen_engine(res)
    if engine != res.engine:
        res = res.with_engine(engine)
    # thinking on (in some rows of a mixture), or a verifier that always reasons: the local engine hands
    # reasoning back split out, as vLLM's parser for the verifier's format does (qwen3, openai_gptoss)
    fmt = res.reasoning_format
    thinks = res.recipe.may_think or fmt.always
    extra = ["--reasoning-parser", fmt.parser] if res.engine == "local" and thinks and fmt.parser else None
    return server_plan(res, "chat", api_key=api_key, extra_args=extra)


# ---- the servers a stage starts -----------------------------------------------------------------


@contextmanager
def managed_server(res: Resolved, role: str, port: int | None = None,
                   plan: ServerPlan | None = None) -> Iterator[ManagedServer]:
    """A healthy server for `role` (its log in the run's logs/); stopped afterwards.
    plan: the one a stage plan holds (else planned here)."""
    from dspark_kit.engines import servers

    plan = plan or server_plan(res, role, port=port)
    with servers.managed_server(plan, res.run.server_log(role), res.recipe.serve.startup_timeout) as srv:
        yield srv


@contextmanager
def running_server(res: Resolved, role: str, port: int | None = None,
                   plan: ServerPlan | None = None) -> Iterator[str]:
    """Yield the base URL of a healthy server for `role`; stop it afterwards."""
    with managed_server(res, role, port=port, plan=plan) as srv:
        yield srv.base_url


@contextmanager
def hidden_state_server(res: Resolved, plan: ServerPlan | None = None) -> Iterator[HiddenStateEndpoint]:
    """hidden_states.endpoint when given, else a started extraction server (`plan`: the stage plan's,
    else planned here)."""
    from dspark_kit.engines import servers

    endpoint = res.recipe.hidden_states.endpoint
    if not endpoint:
        plan = plan or server_plan(res, "hidden-states")
    with servers.hidden_state_server(endpoint, plan, res.run.server_log("hidden-states"),
                                     res.recipe.serve.startup_timeout) as found:
        yield found
