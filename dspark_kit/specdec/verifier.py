"""The verifier LLM under transformers: one loader and one aux hidden-state tap.

Layer ids follow vLLM (docs/CONCEPTS.md#layer-ids): id k < N is the residual stream entering
decoder layer k (HF `output_hidden_states[k]`); id N (= number of layers) is the
last layer's output *before* the final norm. HF's last `hidden_states` entry is
after the norm, so `LayerTap` takes id N with a forward hook on the last layer.
Every stage that reads aux states (offline files, the local hidden-states
server, the reference decoder) goes through `LayerTap`, so they cannot drift.
"""

from __future__ import annotations

from typing import Self

import torch

from dspark_kit.devices import detect_device
from dspark_kit.specdec.verifier_facts import (  # noqa: F401 (config-only facts: no torch; re-exported)
    num_layers_of,
    param_count,
    verifier_config,
)


def resolve_device(device: str) -> str:
    """'auto' | 'cpu' | 'cuda' | 'npu', optionally ':index' -> a torch device string."""
    kind, sep, index = device.partition(":")
    return detect_device(kind) + sep + index


def load_verifier(path, device: str = "auto", dtype: str = "float32", trust_remote_code: bool = False):
    """The causal LM in eval mode on `device` (decided by devices.detect_device)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    return model.to(resolve_device(device)).eval()


def load_tokenizer(path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def decoder_layers(model):
    """The decoder layer list of a causal LM (or of its inner base model)."""
    return getattr(model, "model", model).layers


def check_layer_ids(layer_ids, num_layers: int, field: str = "layer ids") -> list[int]:
    bad = [i for i in layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"{field}: {bad} outside 0..{num_layers} for a {num_layers}-layer verifier "
                         f"(vLLM convention: id {num_layers} = last layer before the final norm)")
    return list(layer_ids)


class LayerTap:
    """Picks `layer_ids` out of a forward run with `output_hidden_states=True`.

    The hook stays on the last layer until `remove()` (or the end of a `with`
    block), so the same tap serves cached and uncached forwards.
    """

    def __init__(self, model, layer_ids, field: str = "layer ids"):
        self.model = model
        layers = decoder_layers(model)
        self.num_layers = len(layers)
        self.layer_ids = check_layer_ids(layer_ids, self.num_layers, field)
        self._last: torch.Tensor | None = None
        self._handle = layers[-1].register_forward_hook(self._keep_last_output)

    def _keep_last_output(self, _module, _inputs, output):
        self._last = output[0] if isinstance(output, tuple) else output

    def select(self, hidden_states) -> torch.Tensor:
        """HF hidden_states of the forward just run (batch of 1) -> [seq, len(layer_ids), hidden]."""
        picked = [self._last[0] if i == self.num_layers else hidden_states[i][0] for i in self.layer_ids]
        return torch.stack(picked, dim=1)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Uncached forward of the decoder stack (no LM head): [seq] ids -> [seq, len(ids), hidden]."""
        inner = getattr(self.model, "model", self.model)
        out = inner(input_ids=input_ids[None], output_hidden_states=True, use_cache=False)
        return self.select(out.hidden_states)

    @torch.inference_mode()
    def batch(self, input_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The same for rows of one length, no padding: [rows, seq] -> [rows, seq, len(ids), hidden],
        in `dtype` when given (converted while stacking: no full-precision copy of the stack)."""
        inner = getattr(self.model, "model", self.model)
        hs = inner(input_ids=input_ids, output_hidden_states=True, use_cache=False).hidden_states
        picked = [self._last if i == self.num_layers else hs[i] for i in self.layer_ids]
        rows, seq, hidden = picked[0].shape
        out = picked[0].new_empty((rows, seq, len(picked), hidden), dtype=dtype or picked[0].dtype)
        for k, h in enumerate(picked):
            out[:, :, k] = h
        return out

    def remove(self) -> None:
        self._handle.remove()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc) -> None:
        self.remove()


SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS


def sample_token(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                 gen: torch.Generator | None = None) -> int:
    """Greedy at temperature 0, else (nucleus) sampling on the CPU with `gen` (None: global RNG)."""
    if temperature < SAMPLING_EPS:  # as vLLM: a temperature this small is greedy (1/T would overflow)
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
        keep[0] = True  # the top token always stays (a top_p below float32's range compares as 0)
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
