"""Preflight's look at training memory: a device whose planned peak (resolved/memory_plan.py) exceeds
its memory (train.device_memory_gib, else this machine's device) is an error naming the cheapest
fixes in order, each with the peak it plans."""

from __future__ import annotations

from dspark_kit.findings import Finding
from dspark_kit.recipe import RecipeError
from dspark_kit.resolved import Resolved


def memory_findings(res: Resolved) -> list[Finding]:
    from dspark_kit.resolved.memory_plan import fixes_line, human, plan_for

    try:
        plan = res.memory_plan
    except (RecipeError, OSError, ValueError):
        return []  # the dry run and preflight print why it is not planned
    out = []
    trainer = plan.trainer
    if trainer.fits is False:
        fixes = fixes_line(res.recipe, plan, lambda **changes: plan_for(res, **changes))
        out.append(Finding("error", "train-memory", (
            f"training plans a peak of {human(trainer.peak)} per {res.train_device.value} device "
            f"(data.seq_length {plan.seq_length}, train.max_anchors {plan.max_anchors}, gradient checkpointing "
            f"{'on' if plan.gradient_checkpointing else 'off'}) but one has {human(trainer.capacity)} "
            f"({trainer.capacity_source}); cheapest fixes in order: {fixes}")))
    server = plan.server
    if server is not None and server.fits is False:
        from dspark_kit.resolved.memory_plan import server_fixes

        device = res.train_device.value
        capacity = res.memory_plan.trainer.capacity
        if server.role.startswith("verifier server"):
            terms = " + ".join(f"{t.name} {human(t.bytes)} ({t.formula})" for t in server.terms)
            out.append(Finding("error", "server-memory", (
                f"the {server.role} needs {human(server.peak)} per device = {terms}; its budget is "
                f"{human(server.capacity)} ({server.capacity_source}); fixes: "
                f"{server_fixes(res, device, capacity, server)}")))
        else:
            out.append(Finding("error", "server-memory", f"the hidden-state server plans {human(server.peak)} on a "
                                                         f"device of {human(server.capacity)}: use more devices or "
                                                         "offline hidden states"))
    return out
