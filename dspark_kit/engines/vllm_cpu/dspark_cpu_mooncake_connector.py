"""hs_connectors' Mooncake connector for extract_hidden_states, made to run on vLLM's CPU build.

Like dspark_cpu_hs_connector.py this runs INSIDE the vLLM server process and
imports only vllm, torch and hs_connectors (which the CPU build's venv then
needs, with mooncake-transfer-engine). The stock connector asks
`torch.accelerator` for a copy stream and events and, on a machine without
one, stops the engine at startup ("No accelerator is available."). On CPU the
KV cache already lives in host memory: there is no device-to-host copy to
overlap, so the stream and events become no-ops and everything else (the
store, the manifest, the writer threads, when a request is reported done) is
the stock class's own.
"""

from __future__ import annotations

import contextlib

from hs_connectors.mooncake_hidden_states_connector import MooncakeHiddenStatesConnector


class _HostStream:
    def wait_event(self, event) -> None:
        pass


class _HostEvent:
    def record(self, stream=None) -> None:
        pass


class _HostDevice:
    """The slice of torch.cuda's stream API the connector uses, for host memory (nothing to wait on)."""

    Stream = _HostStream
    Event = _HostEvent

    @staticmethod
    @contextlib.contextmanager
    def stream(stream):
        yield stream


class CpuMooncakeHiddenStatesConnector(MooncakeHiddenStatesConnector):
    """MooncakeHiddenStatesConnector with host-memory streams and events."""

    def _device(self):
        return _HostDevice
