"""Check a recipe and its run directory against the ten silent acceptance killers (+ multi-node reachability).

Each pitfall of docs/PITFALLS.md loads, trains and serves without an error and
only shows up as a low acceptance length much later. `run_preflight` looks at
the recipe and whatever artifacts already exist in the work dir (regen jsonl,
prepared data, hidden states, checkpoints) and reports one Finding per
problem, tagged with the pitfall number. Missing artifacts are not faults:
preflight runs before, between and after the stages.
"""

from __future__ import annotations

from dspark_kit.findings import (
    PITFALLS,  # noqa: F401 - the pitfall titles, re-exported
    Finding,
)
from dspark_kit.resolved import Resolved
from dspark_kit.specdec import checkpoints as ckpt
from dspark_kit.stages.preflight.context import (  # noqa: F401 - re-exported: callers import them from here
    _Context,
    label,
    pitfall,
)
from dspark_kit.stages.preflight.data_checks import (
    check_models,
    check_thinking,
)
from dspark_kit.stages.preflight.draft_checks import (
    check_checkpoint,
    check_layers,
    check_markov,
    check_mask,
    check_sliding,
)
from dspark_kit.stages.preflight.machine_checks import (  # noqa: F401 - re-exported: callers import them from here
    NODE_LOCAL_DIRS,
    WEIGHT_FILES,
    check_hidden_dtype,
    check_memory,
    check_multinode,
    check_storage,
    check_train_memory,
    check_transport,
    check_verifier,
)
from dspark_kit.stages.preflight.serving_checks import (
    check_endpoints,
    check_engine,
    check_lengths,
    check_parallel,
    check_ports,
    check_prompt_room,
    check_windows,
)

CHECKS = [check_verifier, check_memory, check_markov, check_sliding, check_models, check_thinking, check_layers, check_mask,
          check_windows, check_checkpoint, check_engine, check_parallel, check_lengths, check_prompt_room, check_ports,
          check_multinode, check_transport, check_hidden_dtype, check_storage, check_endpoints,
          check_train_memory]  # fmt: skip


def _context(res: Resolved, checkpoints: bool = True) -> _Context:
    ctx = _Context(res)
    if not checkpoints:
        return ctx
    try:
        ctx.checkpoint = res.checkpoint
        ctx.checkpoint_config = res.checkpoint_config
    except ckpt.CheckpointError:
        pass  # check_checkpoint reports it when a checkpoints dir exists
    return ctx


def run_preflight(res: Resolved, *, probes: bool = True, checkpoints: bool = True,
                  checkpoint_checked: bool = False, storage: bool = True, training: bool = True) -> list[Finding]:
    """All findings for the caller's resolution (recipe, run folder, --engine, --checkpoint) and
    the artifacts in its run folder.

    `checkpoints=False` ignores DIR/checkpoints: before training they are the
    stage's own output (an interrupted run leaves them partial), not an input.
    `checkpoint_checked`: the caller already judged the checkpoint (serve): not again.
    `storage=False`: past the hidden-states stage (train, serve) their room is no question.
    `training=False`: past training (serve) its memory is no question.
    """
    ctx = _context(res, checkpoints)
    skip = {check_markov} if not probes else set()
    if not checkpoints or checkpoint_checked:
        skip.add(check_checkpoint)
    if not storage:
        skip.add(check_storage)
    if not training:
        skip.add(check_train_memory)
    findings = [f for check in CHECKS if check not in skip for f in check(ctx)]
    return sorted(findings, key=lambda f: (f.pitfall or 99, f.level != "error"))  # no pitfall (storage): last


def has_errors(findings: list[Finding]) -> bool:
    return any(f.level == "error" for f in findings)


class PreflightError(ValueError):
    """Preflight found errors; the message lists each with its pitfall number."""


def enforce(res: Resolved, stage: str, log=None, checkpoint_checked: bool = False) -> list[Finding]:
    """Run before train and serve: warnings are printed, errors stop the stage.

    Probes are skipped here: the training process applies the speculators fixes itself.
    """
    from dspark_kit.progress import note

    findings = run_preflight(res, probes=False, checkpoints=stage != "train", checkpoint_checked=checkpoint_checked,
                             storage=False, training=stage == "train")
    for f in findings:
        if f.level == "warning":
            (log or note)(f"preflight warning ({label(f)}): {f.message}")
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise PreflightError(f"preflight stopped {stage}: " + "; ".join(
            f"[{label(f)}] {f.message}" for f in errors) + " (see `dspark-kit preflight`)")
    return findings
