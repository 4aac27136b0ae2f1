"""What a server plan reads, as plain values: the stage asks the resolver once
(stages/server_plan.py `serve_inputs`) and hands the engine these records.

`ServeInputs` holds what every engine's plan reads for one role (the verifier, the names the
server answers to, device and dtype), and per role what only that role reads: the exported
layers and the files' dtype (hidden-states), the draft and its decisions (`SpecInputs`, spec).
A decided value (K, window, adaptive verification, top-k) travels as the resolver's frozen
decision record: its value, where it came from, and its notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dspark_kit.recipe import Recipe


class Decided(Protocol):
    """A decided value as a plan reads it: the value, where it came from, the warnings it carries."""

    @property
    def value(self) -> Any: ...

    @property
    def source(self) -> str: ...

    @property
    def notes(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class SpecInputs:
    """Role spec: the draft checkpoint and what was decided for it."""

    checkpoint: Path
    k: Decided
    window: Decided
    decision_lines: tuple[str, ...]  # K and the draft window, one informational line each
    exists: bool = True  # vllm: the checkpoint is there (else planned: train writes it)
    adaptive: Decided | None = None  # vllm, vllm-ascend: adaptive verification
    topk: Decided | None = None  # vllm, vllm-ascend: the draft's top-k
    gate_message: str = ""  # vllm, vllm-ascend: the engine gate's line (a gate that fails stops the stage first)
    engine_version: str | None = None  # vllm, vllm-ascend: the release judged
    engine_features: Any = None  # vllm, vllm-ascend: what that release takes (compat.versions features)


@dataclass(frozen=True)
class ServeInputs:
    """What a role's server plan reads (engines/local/plan.py, engines/vllm.py, engines/llamacpp.py)."""

    recipe: Recipe
    engine: str
    verifier_path: str = ""  # the verifier's loadable path (llama.cpp: unread, its plan has the GGUF file)
    served_names: tuple[str, ...] = ()  # the model ids the server answers to, in /v1/models order
    device: str = ""  # where it serves (local, vllm on an accelerator)
    dtype: str = ""  # local, vLLM's CPU build
    on_cpu: bool = False  # vllm: vLLM's CPU build
    exported_layer_ids: tuple[int, ...] = ()  # hidden-states
    hidden_states_dtype: str | None = None  # hidden-states: the files' dtype
    mooncake: Any = None  # hidden-states over Mooncake (distributed.hs_transport.Mooncake), else None
    spec: SpecInputs | None = None  # spec
    llamacpp: Any = None  # llama.cpp: the engine's plain values (engines/llamacpp.LlamaCppServe)
    planning: bool = False  # a dry run: llama.cpp's build is not required
