"""speculators fixes DSpark training depends on, each guarded by a behavioural probe.

DSpark training on Ascend needs four speculators fixes: (a) slot-0 loss
weight 1 under sample_from_anchor, (b) device adaptation, (c) Markov
prev_token_ids = block_tokens (no shift), (d) slot-0 counted in the metrics.
speculators 0.9.0 ships (a), (c), (d); (b) is still partial (docs/CONCEPTS.md#speculators-on-cpu-and-npu).
The probes and patches live in dspark_fixes.py ((a), (c), (d)) and
device_fixes.py ((b)); stop_fixes.py keeps a stop from being lost in a log write. This
module keeps the list, probes and applies them.
Every fix here has a probe that runs the *installed* code on a tiny input and
checks the result; the patch is applied only when the probe fails, so a newer
speculators is used as is and an older tree gets exactly the missing fix.
Call `apply_for_training(device)` in every training process before
speculators' train main runs (dspark_kit.compat.train_entry does).

Probes run with torch.compile off (`torch.compiler.set_stance("force_eager")`):
speculators wraps DSpark's forward in torch.compile whenever CUDA is available
(`conditional_torch_compile`, decided at import), and the probes' tiny CPU
tensors would otherwise send Inductor into a C++ build for the CPU (minutes or
a hang on a GPU machine). A probe that crashes is "probe failed", never "fix
needed": `apply_for_training` then refuses (ProbeFailed) instead of patching
on a guess.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dspark_kit.compat.device_fixes import (
    Replacements,
    patch_checkpointer_device,
    patch_cpu_bf16_attention,
    patch_distributed_setup,
    patch_local_rank,
    patch_seed,
    patch_synchronize,
    patch_trainer_device_type,
    probe_checkpointer_device,
    probe_cpu_bf16_attention,
    probe_distributed_setup,
    probe_local_rank,
    probe_seed,
    probe_synchronize,
    probe_trainer_device_type,
)
from dspark_kit.compat.dspark_fixes import (
    patch_markov_prev_token,
    patch_pos0_decay,
    patch_slot0_metrics,
    probe_markov_prev_token,
    probe_pos0_decay,
    probe_slot0_metrics,
)
from dspark_kit.compat.stop_fixes import patch_stop_in_log_write, probe_stop_in_log_write
from dspark_kit.devices import detect_device

ALL_DEVICES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class ProbeResult:
    name: str
    ok: bool
    detail: str
    failed: bool = False  # the probe itself crashed: detail is "probe failed: <reason>"


class ProbeFailed(RuntimeError):
    """A fix probe crashed: whether the fix is needed is unknown, so nothing is patched."""


@dataclass(frozen=True)
class Fix:
    name: str
    summary: str
    probe: Callable[[str], tuple[bool, str]]  # device -> (ok, detail)
    patch: Callable[[str], Replacements]  # device -> what to replace
    devices: tuple[str, ...] = ALL_DEVICES
    upstream: str | None = None  # the speculators PR that fixed it; None: no upstream fix yet
    fixed_in: str | None = None  # first speculators release with the fix (its probe passes there)


_ORIGINALS: list[tuple[object, str, object]] = []


def _replace(owner: object, attr: str, value: object) -> None:
    _ORIGINALS.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, value)


_DEVICE_ONLY = ("cpu", "npu")  # cuda is what speculators was written for
FIXES: list[Fix] = [
    Fix("pos0-decay", "(a) slot-0 loss weight 1 under sample_from_anchor (PR#798)",
        probe_pos0_decay, patch_pos0_decay,
        upstream="vllm-project/speculators#798", fixed_in="0.7.0"),
    Fix("markov-prev-token", "(c) Markov prev_token_ids = block_tokens, no shift (PR#806)",
        probe_markov_prev_token, patch_markov_prev_token,
        upstream="vllm-project/speculators#806", fixed_in="0.7.0"),
    Fix("slot0-metrics", "(d) accept_len/eal/accuracy count slot 0 (PR#805)",
        probe_slot0_metrics, patch_slot0_metrics,
        upstream="vllm-project/speculators#805", fixed_in="0.7.0"),
    Fix("device-local-rank", "(b) Trainer moves the model to this device",
        probe_local_rank, patch_local_rank, _DEVICE_ONLY),
    Fix("device-trainer-type", "(b) Trainer.device_type is this device (autocast)",
        probe_trainer_device_type, patch_trainer_device_type, _DEVICE_ONLY),
    Fix("device-synchronize", "(b) step timer synchronize works without an accelerator",
        probe_synchronize, patch_synchronize, ("cpu",)),
    Fix("device-checkpointer", "(b) resume loads checkpoints onto this device",
        probe_checkpointer_device, patch_checkpointer_device, _DEVICE_ONLY),
    Fix("device-seed", "(b) set_seed seeds this device, not torch.cuda",
        probe_seed, patch_seed, _DEVICE_ONLY),
    Fix("device-distributed", "(b) torchrun workers start a gloo process group on cpu",
        probe_distributed_setup, patch_distributed_setup, ("cpu",)),
    Fix("device-cpu-bf16-attention", "(b) the draft's bf16 attention runs where these CPU kernels run it",
        probe_cpu_bf16_attention, patch_cpu_bf16_attention, ("cpu",)),
    Fix("stop-in-log-write", "a SIGTERM or Ctrl-C that lands in a log line still saves `interrupted`",
        probe_stop_in_log_write, patch_stop_in_log_write),
]  # fmt: skip


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """torch.compile'd functions run as plain Python: probes never compile."""
    import torch

    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:  # torch < 2.6 (speculators 0.9 needs >= 2.9)
        with torch._dynamo.config.patch(disable=True):
            yield
        return
    with set_stance("force_eager"):
        yield


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _run_probe(fix: Fix, device: str) -> ProbeResult:
    try:
        with _eager():
            ok, detail = fix.probe(device)
    except Exception as e:  # noqa: BLE001 - a crash is a failed probe, reported in one line
        reason = _one_line(f"{type(e).__name__}: {e}")
        return ProbeResult(fix.name, False, f"probe failed: {reason}", failed=True)
    return ProbeResult(fix.name, bool(ok), detail)


def refusal(result: ProbeResult, device: str) -> str:
    """The one line train stops with when a probe failed."""
    return (
        f"speculators fix {result.name}: {result.detail}; not patching on a guess "
        f"(see `dspark-kit doctor --probe-device {device}`)"
    )


def _prepare_device(device: str) -> None:
    if device == "npu":
        importlib.import_module("torch_npu")  # registers torch.npu; no transfer_to_npu


def probe(name: str, device: str = "cpu") -> ProbeResult:
    """Run one fix's probe by name (e.g. "markov-prev-token")."""
    return _run_probe(next(f for f in FIXES if f.name == name), device)


def installed_fingerprint() -> str | None:
    """What a probe's answer depends on, read without importing anything: the installed speculators'
    and torch's versions, speculators' source files (path, size, mtime) and the CPU kernels asked for
    (ATEN_CPU_CAPABILITY). None: not installed."""
    import hashlib
    import importlib.metadata
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        return None
    import os

    h = hashlib.sha256()
    h.update(f"kernels={os.environ.get('ATEN_CPU_CAPABILITY', '')};".encode())  # the CPU attention fix's answer
    for dist in ("speculators", "torch"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)};".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=none;".encode())
    for root in spec.submodule_search_locations:
        for f in sorted(Path(root).rglob("*.py")):
            st = f.stat()
            h.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def cached_probe(name: str, device: str = "cpu") -> ProbeResult:
    """probe(), remembered per installed speculators (installed_fingerprint) in the kit's cache: the
    answer cannot change while those files do not, and importing speculators to ask again costs
    preflight ~7 s. A process that has speculators imported already probes it as it is (free then,
    and its modules may be patched). A probe that crashed is never remembered. Training always
    probes afresh."""
    import json
    import sys

    from dspark_kit.data.tiny_verifier import cache_root

    if "speculators" in sys.modules:
        return probe(name, device)
    key = installed_fingerprint()
    path = cache_root() / "probes" / f"{name}-{device}-{key}.json"
    if key is not None and path.is_file():
        try:
            return ProbeResult(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # a damaged entry: probe again
    result = probe(name, device)
    if key is not None and not result.failed:
        import dataclasses

        from dspark_kit.atomic import write_text

        write_text(path, json.dumps(dataclasses.asdict(result)))
    return result


def probe_all(device: str | None = None) -> list[ProbeResult]:
    """Probe every fix that applies to `device` (default: this machine's)."""
    device = device or detect_device()
    _prepare_device(device)
    return [_run_probe(fix, device) for fix in FIXES if device in fix.devices]


def apply_for_training(device: str) -> list[str]:
    """Patch what this speculators gets wrong on `device`; return the patch names.

    Every probe runs once before anything is patched: if one crashed, raise
    ProbeFailed (one line) and leave speculators untouched. Then fix by fix, in
    order (a later probe sees the earlier patches): probe, patch, re-probe.
    """
    _prepare_device(device)
    fixes = [fix for fix in FIXES if device in fix.devices]
    for fix in fixes:
        if (first := _run_probe(fix, device)).failed:
            raise ProbeFailed(refusal(first, device))
    applied = []
    for fix in fixes:
        before = _run_probe(fix, device)
        if before.failed:
            raise ProbeFailed(refusal(before, device) + f" (after patches {applied})")
        if before.ok:
            continue
        for owner, attr, value in fix.patch(device):
            _replace(owner, attr, value)
        applied.append(fix.name)
        after = _run_probe(fix, device)
        if after.failed:
            raise ProbeFailed(refusal(after, device) + f" (after patch {fix.name})")
        if not after.ok:
            raise RuntimeError(
                f"speculators fix {fix.name} {fix.summary}: still failing after the patch "
                f"({after.detail}); upgrade speculators (pip install -U speculators)"
            )
    return applied
