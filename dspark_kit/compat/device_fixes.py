"""speculators' device assumptions on this device (docs/CONCEPTS.md#speculators-on-cpu-and-npu).

Probes and patches used by dspark_kit.compat.patches: each probe runs the installed
speculators code and checks it does not assume cuda on `device`; each patch returns
(owner, attribute, replacement) triples that patches.py applies.
"""

from __future__ import annotations

import importlib
import os

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


# torch 2.13's CPU flash attention packs bf16 blocks with AVX-512 VNNI code whenever the CPU has AMX
# (cpuinfo), even when ATen dispatches to kernels below AVX-512 (ATEN_CPU_CAPABILITY=default or avx2):
# from 64 tokens on, bf16 scaled_dot_product_attention raises "pack_vnni2 is only supported when
# avx512 is supported". The draft trains in bf16, so its sdpa attention dies on such a machine.
_ATTN_PROBE_TOKENS = 64


def _sdpa_function():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def probe_cpu_bf16_attention(device: str) -> tuple[bool, str]:
    """The draft's sdpa attention (transformers' function, as speculators calls it) forward and
    backward over a block-masked 64-token sequence, on this machine's CPU kernels: in bf16, and in
    float32 under bf16 autocast (how speculators' Trainer runs it)."""
    import torch

    kernels = torch.backends.cpu.get_cpu_capability()
    shape = (1, 2, _ATTN_PROBE_TOKENS, 32)
    mask = torch.ones(1, 1, _ATTN_PROBE_TOKENS, _ATTN_PROBE_TOKENS, dtype=torch.bool).tril()
    module = torch.nn.Module()
    module.is_causal = False
    try:
        for dtype, autocast in ((torch.bfloat16, False), (torch.float32, True)):
            q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out, _ = _sdpa_function()["sdpa"](module, q, k, v, mask, dropout=0.0, scaling=32 ** -0.5)
            out.float().sum().backward()
    except RuntimeError as e:
        return False, f"bf16 sdpa attention on these CPU kernels ({kernels}): {' '.join(str(e).split())[:200]}"
    return True, f"bf16 sdpa attention runs on these CPU kernels ({kernels})"


def patch_cpu_bf16_attention(device: str) -> Replacements:
    """The draft's sdpa attention computes a low-precision call (bf16/fp16 inputs, or CPU autocast)
    in float32 with autocast off, and returns what the call would have: the same math, through
    kernels that run here."""
    import torch

    functions = _sdpa_function()
    original = functions["sdpa"]

    def sdpa_in_float32(module, query, key, value, attention_mask, *args, **kwargs):
        autocast = torch.is_autocast_enabled("cpu")
        if query.dtype not in (torch.bfloat16, torch.float16) and not autocast:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        dtype = torch.get_autocast_dtype("cpu") if autocast else query.dtype
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        with torch.autocast("cpu", enabled=False):
            out, weights = original(module, query.float(), key.float(), value.float(), attention_mask,
                                    *args, **kwargs)
        return out.to(dtype), weights

    return [(functions, "_local_mapping", {**functions._local_mapping, "sdpa": sdpa_in_float32})]
