"""What an hs_{i}.safetensors file holds for each hidden_states.dtype, and what it costs on disk.

bfloat16, float32: `hidden_states` [seq, layers, hidden] in that dtype and `token_ids` int64
[seq] (vLLM's ExampleHiddenStatesConnector's files). fp8: hs-connectors' FP8HiddenStatesConnector's
files: `hidden_states` in float8_e4m3fn, scaled per token by `hidden_states_scales` float32
[seq, 1, 1] (hs_connectors/fp8_utils.py), plus `token_ids`. The kit quantizes and dequantizes
with hs-connectors' own functions, so its files are the connector's and speculators' trainer
reads them through its `--hidden-states-backend fp8` (FP8Transfer dequantizes to bfloat16).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from dspark_kit.recipe import DTYPE_BYTES

if TYPE_CHECKING:
    import torch

FP8 = "fp8"
ID_BYTES = 8  # token_ids: int64 per token
SCALE_BYTES = 4  # fp8: one float32 scale per token
# safetensors' JSON header, per tensor, rounded up (measured 76-84 B: name, dtype, shape, offsets)
HEADER_BYTES_PER_TENSOR = 100


def token_bytes(layers: int, hidden: int, dtype: str) -> int:
    """Bytes one token takes in a file: its states at every exported layer, its id, its fp8 scale."""
    return layers * hidden * DTYPE_BYTES[dtype] + ID_BYTES + (SCALE_BYTES if dtype == FP8 else 0)


def header_bytes(dtype: str) -> int:
    """Bytes of one file's header (three tensors in fp8 files, two otherwise)."""
    return HEADER_BYTES_PER_TENSOR * (3 if dtype == FP8 else 2)


def file_tensors(hidden_states: torch.Tensor, token_ids: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """The tensors of one row's file: [seq, layers, hidden] states (any float dtype) in `dtype`."""
    import torch

    if dtype != FP8:
        return {"hidden_states": hidden_states.to(getattr(torch, dtype)).contiguous(), "token_ids": token_ids}
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    fp8, scales = quantize_tensor_to_fp8(hidden_states)
    return {"hidden_states": fp8.contiguous(), SCALES_KEY: scales.contiguous(), "token_ids": token_ids}


def dtype_of(tensors: dict[str, torch.Tensor]) -> str:
    """The hidden_states.dtype a file was written in."""
    from hs_connectors.fp8_utils import SCALES_KEY

    return FP8 if SCALES_KEY in tensors else str(tensors["hidden_states"].dtype).removeprefix("torch.")


def readable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A file's tensors as a reader uses them: fp8 states dequantized (bfloat16, as speculators'
    FP8Transfer hands them to the trainer), others as they are."""
    from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor

    if SCALES_KEY not in tensors:
        return tensors
    out = {k: v for k, v in tensors.items() if k != SCALES_KEY}
    out["hidden_states"] = dequantize_fp8_tensor(tensors["hidden_states"], tensors[SCALES_KEY])
    return out


def load(path: Path | str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return readable(load_file(str(path)))


@functools.cache
def fp8_unavailable() -> str | None:
    """Why hidden_states.dtype fp8 cannot run with the installed hs-connectors (None: it can). It
    needs the connector module (what vLLM loads), fp8_utils (what the kit writes files with) and
    the trainer's `fp8` backend (what speculators reads them with)."""
    import importlib.util

    from dspark_kit.devices import package_version

    version = package_version("hs-connectors")
    if version is None or importlib.util.find_spec("hs_connectors") is None:
        return "hs-connectors is not installed (speculators installs it; hs-connectors>=0.9.0 has the fp8 connector)"
    try:
        has_connector = importlib.util.find_spec("hs_connectors.fp8_hidden_states_connector") is not None
        from hs_connectors import HiddenStatesBackend
        from hs_connectors.fp8_utils import quantize_tensor_to_fp8  # noqa: F401 - present: the writer exists
    except ImportError:
        has_connector = False
    else:
        has_connector = has_connector and FP8 in HiddenStatesBackend.registry
    if not has_connector:
        return f"the installed hs-connectors {version} has no fp8 hidden-states connector (hs-connectors>=0.9.0 has it)"
    return None


def is_valid_file(path: Path, token_ids: list[int], dtype: str | None = None) -> bool:
    """A file that opens, has both keys, the right length and finite values (fp8: once
    dequantized, as the trainer reads it), in `dtype` when given (a run whose
    hidden_states.dtype changed rewrites the files of the other dtype)."""
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states

    try:
        tensors = load_file(str(path))
        if dtype is not None and dtype_of(tensors) != dtype:
            return False
        check_hidden_states(readable(tensors), token_ids)
        return True
    except Exception:  # noqa: BLE001 - any unreadable file is simply regenerated
        return False
