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
import sys
from typing import Literal

Device = Literal["npu", "cuda", "cpu"]
DEVICES: tuple[str, ...] = ("npu", "cuda", "cpu")

# Defaults for single-node Ascend runs (docs/ASCEND.md#the-npu-environment); the user's env wins.
NPU_ENV_DEFAULTS = {
    "HCCL_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
    "HCCL_NPU_SOCKET_PORT_RANGE": "18500-18749",
    "HCCL_OP_EXPANSION_MODE": "AIV",
}
VISIBLE_DEVICES_VAR = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
# The packages whose versions the kit records (doctor, the manifest) and gates on (compat/versions):
# pip's distribution name, then the spellings people type. The one list; everything else asks it.
TRACKED_PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "torch-npu": ("torch-npu", "torch_npu"),
    "speculators": ("speculators",),
    "transformers": ("transformers",),
    "vllm": ("vllm",),
    "vllm-ascend": ("vllm-ascend", "vllm_ascend"),
    "triton": ("triton",),
}
VERSIONED_PACKAGES = tuple(TRACKED_PACKAGES)


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


# Device nodes a CUDA (or ROCm, whose torch answers torch.cuda) device shows up as on Linux, WSL 2
# included. Without any, torch.cuda.is_available() is False: a plan decides "cpu" without importing
# torch (2-3 s of a dry run or preflight). A process that has torch already asks it (free then, and
# what it says wins: a test may emulate a CUDA machine).
CUDA_DEVICE_NODES = ("/dev/nvidia*", "/dev/kfd", "/dev/dxg")


def cuda_possible() -> bool:
    import glob

    return any(glob.glob(pattern) for pattern in CUDA_DEVICE_NODES)


def cuda_available() -> bool:
    if "torch" not in sys.modules and not cuda_possible():
        return False
    import torch

    return bool(torch.cuda.is_available())


def detect_device(requested: str = "auto") -> Device:
    """Resolve `train.device` / `--target-device` / `--probe-device`: auto prefers npu, then cuda, then cpu."""
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


def visible_count(device: str) -> int | None:
    """Accelerators of this kind visible here; None when this machine has none of them."""
    if device == "cuda" and cuda_available():
        import torch

        return int(torch.cuda.device_count())
    if device == "npu" and npu_available():
        import torch

        return int(torch.npu.device_count())
    return None


def visible_devices_env(device: str, ids: str | None) -> dict[str, str]:
    """Env that restricts a process to `ids` ("0,1"); empty for cpu or ids=None."""
    if not ids or device not in VISIBLE_DEVICES_VAR:
        return {}
    return {VISIBLE_DEVICES_VAR[device]: ids.replace(" ", "")}


def npu_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """HCCL/GLOO settings for NPU processes; values already set by the user are kept."""
    environ = os.environ if environ is None else environ
    return {key: environ.get(key, default) for key, default in NPU_ENV_DEFAULTS.items()}


def device_env(device: str, ids: str | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Env a process on `device` needs (training and serving alike): NPU defaults (HCCL etc.)
    unless the user's environment sets them, plus the visible-device variable the recipe names."""
    env = npu_env(os.environ if environ is None else environ) if device == "npu" else {}
    return {**env, **visible_devices_env(device, ids)}


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


def tracked_name(name: str) -> str:
    """A tracked package's distribution name from any of its spellings (ValueError for others)."""
    key = name.lower().replace("_", "-")
    if key not in TRACKED_PACKAGES:
        raise ValueError(f"versions: unknown package {name!r}; expected one of {', '.join(TRACKED_PACKAGES)}")
    return key


def tracked_version(name: str) -> str | None:
    """Installed version of a tracked package (any of its spellings), or None when absent. torch's
    is its own `__version__`, build tag included (2.11.0+cu130): a CUDA wheel's metadata can leave
    the tag out, and the build is what a manifest must record."""
    if tracked_name(name) == "torch" and package_version("torch"):
        import torch

        return str(torch.__version__)
    return next((v for dist in TRACKED_PACKAGES[tracked_name(name)] if (v := package_version(dist))), None)


def versions() -> dict[str, str | None]:
    out = {"python": platform.python_version()}
    out.update({name: tracked_version(name) for name in TRACKED_PACKAGES})
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


def device_memory_bytes(device: str) -> int | None:
    """Memory of `device` ("cpu", "cuda", "npu", optionally ":index"): the accelerator's total,
    the machine's physical RAM for cpu; None when it cannot be read here."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    available = {"cuda": cuda_available, "npu": npu_available}.get(kind)
    if available is None or not available():
        return None
    import torch

    try:
        return int(getattr(torch, kind).get_device_properties(int(index or 0)).total_memory)
    except (RuntimeError, AssertionError, AttributeError, ValueError):  # a torch build without it, a bad index
        return None
