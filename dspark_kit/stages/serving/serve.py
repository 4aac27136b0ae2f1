"""Serving: plan a server for a role (checks first), and the serve stage of a run.

`plan_server` is what `dspark-kit serve` and the pipeline share: role and
engine checked, the spec checkpoint resolved and judged by the resolver's one
checkpoint check, the whole-recipe preflight, then the engine's plan. The
stage records the exact command in `DIR/serve/serve_command.txt` (what you
run on the Ascend/CUDA box); on the local engine it also starts the server,
sends one chat request and stops it, so a broken checkpoint fails here rather
than in bench.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_kit import atomic
from dspark_kit.engines import ServerPlan
from dspark_kit.recipe import ROLES
from dspark_kit.resolved import Resolved


class ServeError(ValueError):
    """One line naming the setting (or checkpoint finding) and the fix."""


@dataclass
class ServePlan:
    plan: ServerPlan
    resolved: Resolved
    findings: list = field(default_factory=list)  # checkpoint findings (spec)
    warnings: list[str] = field(default_factory=list)  # checkpoint + preflight warnings, plan notes
    mooncake_master: ServerPlan | None = None  # role hidden-states, transport mooncake: started first

    @property
    def decisions(self) -> list[str]:
        """What the plan decided and why (engine gate, K, window, adaptive verification): not warnings."""
        return self.plan.decisions


def plan_server(res: Resolved, role: str, *, port: int | None = None, api_key: str | None = None) -> ServePlan:
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
    return ServePlan(plan, res, findings, warnings + plan.notes, master)


async def smoke_reply(url: str) -> str:
    """One short greedy chat request to a running server: its reply text."""
    from dspark_kit.engines.chat_client import ChatClient, RequestFailed

    async with ChatClient(url, concurrency=1, timeout=300) as client:
        try:
            ids = await client.model_ids()
            out = await client.post_chat({"model": ids[0] if ids else None, "max_tokens": 8, "temperature": 0,
                                          "messages": [{"role": "user", "content": "Count from 1 to 5."}]})
        except RequestFailed as e:
            raise ServeError(f"serve check: the spec server at {url} failed a chat request: {e.reason}") from None
    return out["text"]


def stage_serve_check(res: Resolved, server: ServerPlan | None = None) -> dict:
    """Check the checkpoint serves: write the spec server's command, and with the local engine start
    that server (`server`: the stage plan's) and get one reply from it."""
    import asyncio

    from dspark_kit.engines.servers import running_server

    run = res.run
    sp = plan_server(res, "spec")  # its findings, warnings and decisions
    server = server or sp.plan
    atomic.write_text(run.serve_command, server.shell_line() + "\n")
    result = {"engine": res.engine, "checkpoint": str(res.checkpoint), "command_file": str(run.serve_command),
              "num_speculative_tokens": res.k.value, "draft_window_size": res.window.value,
              "adaptive_verification": res.adaptive_verification.value,
              "warnings": sp.warnings, "decisions": sp.decisions}
    if res.engine == "local":
        with running_server(res, "spec", plan=server) as url:
            result["smoke_reply"] = asyncio.run(smoke_reply(url))
    return result
