"""Preflight checks on how the draft is served: K, slots and the draft window (pitfall 9), the
serving engine against the checkpoint, tensor parallelism, request lengths and prompt room, the
ports the kit's servers take, and external endpoints (endpoints.py).

A floor of stages/ like its package: may import stages/preflight/context.py, its sibling
endpoints.py and prompt_room.py, engines/ports.py, stages/plan.py and the layers below; never a
stage folder or checks.py (the registry imports this).
"""

from __future__ import annotations

from dspark_kit.findings import Finding
from dspark_kit.stages.preflight.context import _Context, pitfall


def check_windows(ctx: _Context) -> list[Finding]:
    """Pitfalls 9 and 10 from the resolver's window decision (the one serving uses), in its words."""
    try:
        window, risks = ctx.res.window.value, ctx.res.window_risks
    except ValueError as e:  # an unreadable tune result
        return [pitfall(9, "error", str(e))]
    out = [pitfall(n, "warning", message) for n, message in risks.items()]
    if window is not None and any("mtp" in a for a in ctx.recipe.serve.extra_args):
        out.append(pitfall(9, "warning", "serve.draft_window_size with method mtp: vllm-ascend ignores "
                                         "the window for mtp; unset it"))  # fmt: skip
    return out


def check_engine(ctx: _Context) -> list[Finding]:
    """The serving engine against the checkpoint (docs/COMPAT.md): DSpark at all, the anchor layout it
    serves the checkpoint in, and adaptive verification that was asked for but cannot work."""
    res = ctx.res
    if res.engine not in ("vllm", "vllm-ascend"):
        return []
    # checkpoints ignored (before train: they are its own output): judge what the trainer will write
    gate = res.engine_gate if ctx.checkpoint_config is not None else res.engine_support.serves()
    out = [Finding("error", "engine", gate.message)] if gate.ok is False else []
    try:
        _ = res.adaptive_verification  # decided on first use; `on` that cannot work raises
    except ValueError as e:  # ResolveError: on, where it cannot work
        out.append(Finding("error", "adaptive-verification", str(e)))
    return out


def check_parallel(ctx: _Context) -> list[Finding]:
    """serve.tensor_parallel_size fits the listed devices and divides the attention heads."""
    from dspark_kit.specdec.verifier_facts import language_model_config

    s, out = ctx.recipe.serve, []
    tp = s.tensor_parallel_size
    listed = [d for d in (s.devices or "").split(",") if d.strip()]
    if listed and tp > len(listed):
        out.append(Finding("error", "tensor-parallel", f"serve.tensor_parallel_size {tp} > the {len(listed)} "
                                                       f"device(s) in serve.devices {s.devices}; list {tp} or lower it"))
    heads = language_model_config(ctx.verifier_config or {}).get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        out.append(Finding("error", "tensor-parallel", f"serve.tensor_parallel_size {tp} does not divide the "
                                                       f"verifier's {heads} attention heads; use a divisor of {heads}"))
    return out


def check_lengths(ctx: _Context) -> list[Finding]:
    """Every regen and bench request fits serve.max_model_len (a prompt plus max_tokens beyond it is a 400)."""
    r, out = ctx.recipe, []
    limit = r.serve.max_model_len
    if limit is None:
        return out
    asks = [("bench.max_tokens", r.bench.max_tokens)]
    if r.regen.enabled:
        asks.insert(0, ("regen.max_tokens", r.regen.max_tokens))
    for key, n in asks:
        if n >= limit:
            out.append(Finding("error", "max-model-len", f"{key} {n} >= serve.max_model_len {limit}: no prompt leaves "
                                                         f"room, so every request is refused; lower {key} or raise "
                                                         "serve.max_model_len"))
    return out


def check_prompt_room(ctx: _Context) -> list[Finding]:
    """regen.max_tokens plus the longest prompt regen will send fits serve.max_model_len (preflight_requests)."""
    from dspark_kit.stages.preflight.prompt_room import prompt_room

    return prompt_room(ctx.res)


def check_ports(ctx: _Context) -> list[Finding]:
    """A configured port the kit's servers will listen on that something holds now. A warning: the
    run itself refuses it before any model loads (engines/ports.py), and preflight may run on
    another machine than the servers."""
    from dspark_kit.engines.ports import busy_message, decide_port, port_in_use

    r = ctx.recipe
    hs = r.hidden_states
    roles = ["spec"]  # serve and bench start the spec server
    if hs.mode == "online" or hs.backend != "local":
        roles += [] if hs.endpoint else ["hidden-states"]
    out = []
    for port in (decide_port(r.serve, role) for role in roles):  # spec: serve.port; hidden-states: its own key
        why = None if port.chosen_at_start else port_in_use(r.serve.host, port.number)
        if why:
            out.append(Finding("warning", "port", busy_message(port, r.serve.host, why)))
    return out


def check_endpoints(ctx: _Context) -> list[Finding]:
    """External servers' /v1/models against the names the trainer and regen will send (preflight_endpoints)."""
    from dspark_kit.stages.preflight.endpoints import endpoint_findings

    return endpoint_findings(ctx.res)
