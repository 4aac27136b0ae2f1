"""hs-connectors' fp8 hidden-states connector, made to run on vLLM's CPU build.

Like dspark_cpu_hs_connector.py this runs INSIDE the vLLM server process and
imports only vllm, torch and hs_connectors (installed with speculators, and in
the CPU build's venv). The stock `FP8HiddenStatesConnector` overrides only the
final write step (`_write_tensors`: quantize to float8_e4m3fn with one float32
scale per token, then save) and inherits vLLM's `_submit_async_write`, which
copies into pinned host memory: on CPU that raises ("pin_memory=True requires
a CUDA or other accelerator backend") on the first request that finishes and
the engine dies. Here the kit's CPU copy (`CpuHiddenStatesConnector`) does the
copy, and it hands the tensors to hs-connectors' own fp8 write step through the
method resolution order, so the file is exactly the stock connector's format.
"""

from __future__ import annotations

from dspark_cpu_hs_connector import CpuHiddenStatesConnector
from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector


class CpuFp8HiddenStatesConnector(CpuHiddenStatesConnector, FP8HiddenStatesConnector):
    """CpuHiddenStatesConnector's host-memory copy, FP8HiddenStatesConnector's write."""
