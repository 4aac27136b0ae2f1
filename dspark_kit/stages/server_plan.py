"""A server's plan for a role, checked first: what `dspark-kit serve`, the serve check, bench and a
served eval start.

`checked_server` checks the role and engine, resolves the spec checkpoint and judges it by the
resolver's one checkpoint check, runs the whole-recipe preflight, then asks the engine for its
plan. `spec_server_lines` is that plan as the lines a stage's dry run prints.

A floor of stages/ above preflight/ and below the stage folders: it may import stages/plan.py,
stages/preflight/ and the layers below, never a stage folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_kit.engines import ServerPlan
from dspark_kit.recipe import ROLES
from dspark_kit.resolved import Resolved
from dspark_kit.stages.plan import Process


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
    from dspark_kit.engines.servers import server_plan
    from dspark_kit.specdec.checkpoints import CheckpointError, errors
    from dspark_kit.stages.preflight.checks import PreflightError, enforce, label

    if role not in ROLES:
        raise ServeError(f"--role {role!r}: expected one of {', '.join(ROLES)}")
    if res.checkpoint_choice is not None and role != "spec":
        raise ServeError(f"--checkpoint: only role spec loads a draft (got --role {role})")
    if res.engine == "vllm":  # before the checkpoint checks: vLLM's CPU build has no role spec
        from dspark_kit.engines.vllm import cpu_refusal

        refused = cpu_refusal(res, role)
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
