"""The one place that knows about npu / cuda / cpu.

Everything device-specific (which env var selects devices, NCCL/HCCL socket
settings, speculators train flags that depend on kernels being present) is
decided here so stages never branch on the device themselves.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
from typing import Literal

Device = Literal["npu", "cuda", "cpu"]
DEVICES: tuple[str, ...] = ("npu", "cuda", "cpu")

# Seed-article defaults for single-node Ascend runs; the user's env wins.
NPU_ENV_DEFAULTS = {
    "HCCL_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
    "HCCL_NPU_SOCKET_PORT_RANGE": "18500-18749",
    "HCCL_OP_EXPANSION_MODE": "AIV",
}
VISIBLE_DEVICES_VAR = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
VERSIONED_PACKAGES = (
    "torch",
    "torch_npu",
    "speculators",
    "transformers",
    "vllm",
    "vllm-ascend",
    "triton",
)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def npu_available() -> bool:
    """True when torch_npu is installed, imports and sees at least one NPU.

    torch_npu is imported lazily: importing it registers the `npu` backend in
    torch, which is exactly what the training process needs anyway.
    """
    if not _installed("torch_npu"):
        return False
    try:
        importlib.import_module("torch_npu")
        import torch

        return bool(torch.npu.is_available())
    except Exception:  # noqa: BLE001 - a broken CANN install must not crash cpu/cuda users
        return False


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def detect_device(requested: str = "auto") -> Device:
    """Resolve `train.device` / `--device`: auto prefers npu, then cuda, then cpu."""
    if requested not in ("auto", *DEVICES):
        raise ValueError(f"device {requested!r}: expected one of auto, npu, cuda, cpu")
    if requested == "npu" and not npu_available():
        raise RuntimeError(
            "device npu: torch_npu not installed or no NPU visible (use auto or cpu)"
        )
    if requested == "cuda" and not cuda_available():
        raise RuntimeError("device cuda: torch.cuda.is_available() is False (use auto or cpu)")
    if requested != "auto":
        return requested  # type: ignore[return-value]
    if npu_available():
        return "npu"
    if cuda_available():
        return "cuda"
    return "cpu"


def visible_devices_env(device: str, ids: str | None) -> dict[str, str]:
    """Env that restricts a process to `ids` ("0,1"); empty for cpu or ids=None."""
    if not ids or device not in VISIBLE_DEVICES_VAR:
        return {}
    return {VISIBLE_DEVICES_VAR[device]: ids.replace(" ", "")}


def npu_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """HCCL/GLOO settings for NPU processes; values already set by the user are kept."""
    environ = os.environ if environ is None else environ
    return {key: environ.get(key, default) for key, default in NPU_ENV_DEFAULTS.items()}


def triton_available() -> bool:
    return _installed("triton")


def train_flags(device: str, has_triton: bool | None = None) -> list[str]:
    """speculators train flags this device needs (kernels that may be absent)."""
    if device == "cpu":
        return ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    if device == "npu":
        # No flex attention on NPU; fused losses are Triton kernels.
        flags = ["--draft-attn-impl", "sdpa"]
        if not (triton_available() if has_triton is None else has_triton):
            flags += ["--loss-implementation", "eager"]
        return flags
    return []


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    out = {"python": platform.python_version()}
    out.update({name: package_version(name) for name in VERSIONED_PACKAGES})
    return out


def _device_names(device: str) -> list[str]:
    import torch

    if device == "cpu":
        return [platform.processor() or platform.machine()]
    module = getattr(torch, device)
    return [str(module.get_device_name(i)) for i in range(module.device_count())]


def describe(requested: str = "auto") -> dict:
    """Device, count, names and package versions, for doctor and run manifests."""
    device = detect_device(requested)
    try:
        names = _device_names(device)
    except Exception as e:  # noqa: BLE001 - names are informative only
        names = [f"unknown ({type(e).__name__})"]
    count = (os.cpu_count() or 1) if device == "cpu" else len(names)
    return {"device": device, "count": count, "names": names, "versions": versions()}


# ---- speculators on this device (seed §5.2 (b), REFERENCE §3) -------------
# Probes and patches used by dspark_kit.compat.patches: each probe runs the installed
# speculators code and checks it does not assume cuda on `device`; each patch
# returns (owner, attribute, replacement) triples that patches.py applies.

Replacements = list[tuple[object, str, object]]


def _device_type(value) -> str:
    import torch

    return torch.device(value).type


def probe_local_rank(device: str) -> tuple[bool, str]:
    rank = importlib.import_module("speculators.train.trainer").get_local_rank()
    try:
        kind = _device_type(rank)
    except (RuntimeError, ValueError) as e:
        return False, f"Trainer moves the model to {rank!r}: {e}"
    return kind == device, f"Trainer moves the model to {rank!r} ({kind}), device is {device}"


def patch_local_rank(device: str) -> Replacements:
    trainer = importlib.import_module("speculators.train.trainer")
    original = trainer.get_local_rank
    rank = (lambda: "cpu") if device == "cpu" else (lambda: f"{device}:{original()}")
    return [(trainer, "get_local_rank", rank)]


def probe_trainer_device_type(device: str) -> tuple[bool, str]:
    """Build a real Trainer (model/optimizer setup skipped) and read its device_type."""
    import tempfile

    trainer_mod = importlib.import_module("speculators.train.trainer")

    class _ProbeTrainer(trainer_mod.Trainer):
        def setup_model(self):
            pass

        def setup_optimizer(self):
            pass

    with tempfile.TemporaryDirectory() as save_path:
        config = trainer_mod.TrainerConfig(lr=1e-4, num_epochs=1, save_path=save_path)
        kind = _ProbeTrainer(None, config, train_loader=None).device_type
    return kind == device, f"Trainer.device_type {kind!r} (autocast/device), device is {device}"


def patch_trainer_device_type(device: str) -> Replacements:
    trainer = importlib.import_module("speculators.train.trainer").Trainer
    setup_trainer = trainer.setup_trainer

    def setup_trainer_on_device(self):
        # __init__ assigned device_type just before; setup_model runs right after.
        self.device_type = device
        return setup_trainer(self)

    return [(trainer, "setup_trainer", setup_trainer_on_device)]


def probe_synchronize(device: str) -> tuple[bool, str]:
    import torch

    try:
        torch.accelerator.synchronize()
    except RuntimeError as e:
        return False, f"torch.accelerator.synchronize (step timer): {e}"
    return True, "torch.accelerator.synchronize works"


def patch_synchronize(device: str) -> Replacements:
    import torch

    original = torch.accelerator.synchronize

    def synchronize(*args, **kwargs):
        if torch.accelerator.is_available():
            return original(*args, **kwargs)
        return None  # nothing asynchronous to wait for on cpu

    return [(torch.accelerator, "synchronize", synchronize)]


def probe_checkpointer_device(device: str) -> tuple[bool, str]:
    where = importlib.import_module("speculators.train.checkpointer").get_current_device()
    kind = _device_type(where) if not str(where).startswith("cuda") else "cuda"
    return kind == device, f"resume loads checkpoints onto {where!r}, device is {device}"


def patch_checkpointer_device(device: str) -> Replacements:
    import torch

    def current_device() -> str:
        if device == "cpu":
            return "cpu"
        return f"{device}:{torch.accelerator.current_device_index()}"

    checkpointer = importlib.import_module("speculators.train.checkpointer")
    return [(checkpointer, "get_current_device", current_device)]


def _device_seeder(device: str):
    import torch

    if device == "cpu":
        return lambda seed: None
    return getattr(torch, device).manual_seed_all


def probe_seed(device: str) -> tuple[bool, str]:
    import random

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        importlib.import_module("speculators.train.cli").set_seed(1234, False)
        if device == "npu" and torch.npu.initial_seed() != 1234:
            return False, "set_seed does not seed the NPU generators (torch.cuda only)"
    except Exception as e:  # noqa: BLE001 - any failure means training would fail
        return False, f"set_seed failed: {type(e).__name__}: {e}"
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
    return True, f"set_seed seeds {device}"


def patch_seed(device: str) -> Replacements:
    import torch

    cli = importlib.import_module("speculators.train.cli")
    set_seed = cli.set_seed

    def set_seed_on_device(seed: int, deterministic: bool = False):
        # set_seed hard-codes torch.cuda.manual_seed_all: route it to this device.
        cuda_seed = torch.cuda.manual_seed_all
        torch.cuda.manual_seed_all = _device_seeder(device)
        try:
            return set_seed(seed, deterministic)
        finally:
            torch.cuda.manual_seed_all = cuda_seed

    return [(cli, "set_seed", set_seed_on_device)]


class _ReachedInit(Exception):
    """Raised by the probe's stand-in init_process_group: setup got that far."""

    def __init__(self, args, kwargs):
        super().__init__("init_process_group reached")
        self.args, self.kwargs = args, kwargs


def probe_distributed_setup(device: str) -> tuple[bool, str]:
    """Run speculators' maybe_setup_distributed as a torchrun worker would, up to init_process_group.

    Nothing connects: init_process_group is replaced by a recorder for the call.
    On cpu, 0.9.0 calls torch.accelerator.set_device_index and asks for an
    accelerator first, so a gloo (CPU) multi-process run dies before it starts.
    """
    import torch.distributed as dist

    mod = importlib.import_module("speculators.train.distributed")
    saved = {k: getattr(mod, k) for k in ("_local_rank", "_is_distributed")}
    old_env = os.environ.get("LOCAL_RANK")
    original = dist.init_process_group

    def recorder(*args, **kwargs):
        raise _ReachedInit(args, kwargs)

    os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group = recorder
    try:
        mod.maybe_setup_distributed()
    except _ReachedInit as r:
        backend = r.args[0] if r.args else r.kwargs.get("backend")
        device_id = r.kwargs.get("device_id")
        if device == "cpu" and (backend != "gloo" or isinstance(device_id, int)):
            return False, f"init_process_group({backend!r}, device_id={device_id!r}) on cpu (needs gloo, no device id)"
        return True, f"process group backend {backend!r}"
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        return False, f"maybe_setup_distributed fails before init_process_group: {type(e).__name__}: {e}"
    finally:
        dist.init_process_group = original
        for k, v in saved.items():
            setattr(mod, k, v)
        if old_env is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = old_env
    return False, "maybe_setup_distributed returned without starting a process group"


def patch_distributed_setup(device: str) -> Replacements:
    """cpu: start the process group with gloo and no device id (the rest as speculators does it)."""
    import torch.distributed as dist

    mod = importlib.import_module("speculators.train.distributed")
    cli = importlib.import_module("speculators.train.cli")
    original = mod.maybe_setup_distributed

    def setup_on_cpu(sp_size: int = 1) -> None:
        if "LOCAL_RANK" not in os.environ:
            return original(sp_size)
        mod._local_rank = int(os.environ["LOCAL_RANK"])
        mod._is_distributed = True
        dist.init_process_group("gloo")
        mod._rank, mod._world_size = dist.get_rank(), dist.get_world_size()
        mod._init_sp_process_groups(mod._rank, mod._world_size, sp_size)
        import sys

        print(f"dspark-kit: gloo process group up, rank {mod._rank} of {mod._world_size}", file=sys.stderr, flush=True)

    return [(mod, "maybe_setup_distributed", setup_on_cpu), (cli, "maybe_setup_distributed", setup_on_cpu)]
