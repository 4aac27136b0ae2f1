"""Verifier-only decoding and hidden-state extraction with transformers.

`VerifierGenerator` implements the `Generator` protocol (engines/__init__.py):
greedy at temperature 0, seeded sampling otherwise, one KV cache per request.
`extract_hidden_states` follows vLLM's layer-id convention (REFERENCE §2):
id k < N is the residual stream entering layer k (HF `hidden_states[k]`);
id N is the output of the last decoder layer *before* the final norm, which
HF does not return (its last entry is post-norm), so a forward hook takes it.
"""

from __future__ import annotations

import time

import torch

from dspark_kit.engines import GenerationResult


def pick_device(device: str) -> str:
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "npu") and torch.npu.is_available():  # torch_npu registers this
        return "npu"
    return "cpu"


def load_verifier(path: str, device: str = "auto", dtype: str = "float32", trust_remote_code=False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    model.to(pick_device(device)).eval()
    return model, tok


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


class VerifierGenerator:
    """Autoregressive decoding of the verifier alone (roles chat / hidden-states)."""

    def __init__(self, model, token_delay_s: float = 0.0):
        self.model = model
        self.device = next(model.parameters()).device
        self.token_delay_s = token_delay_s  # testing aid: mimic a slow large model

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_ids: frozenset[int] = frozenset(),
        top_p: float = 1.0,
    ) -> GenerationResult:
        from transformers import DynamicCache

        gen = None
        if temperature > 0:
            gen = torch.Generator()
            gen.manual_seed(seed if seed is not None else int(time.time_ns() % 2**63))
        cache = DynamicCache()
        step_ids = torch.tensor([prompt_ids], device=self.device)
        out: list[int] = []
        while len(out) < max_new_tokens:
            logits = self.model(input_ids=step_ids, past_key_values=cache, use_cache=True).logits
            token = _sample(logits[0, -1], temperature, top_p, gen)
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            out.append(token)  # like vLLM (and decoder.py), the stop token is part of the output ids
            if token in stop_ids:
                return GenerationResult(out, "stop")
            step_ids = torch.tensor([[token]], device=self.device)
        return GenerationResult(out, "length")


def decoder_layers(model):
    inner = getattr(model, "model", model)
    return inner.layers


@torch.inference_mode()
def extract_hidden_states(model, token_ids: list[int], layer_ids: list[int]) -> tuple[torch.Tensor, int]:
    """[seq, len(layer_ids), hidden] in vLLM's id convention, plus the greedy next token."""
    layers = decoder_layers(model)
    n = len(layers)
    bad = [i for i in layer_ids if not 0 <= i <= n]
    if bad:
        raise ValueError(f"--layer-ids: {bad} outside 0..{n} for a {n}-layer verifier")
    captured: dict[str, torch.Tensor] = {}

    def hook(_module, _inputs, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = layers[-1].register_forward_hook(hook)
    try:
        ids = torch.tensor([token_ids], device=next(model.parameters()).device)
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    picked = [captured["last"][0] if i == n else out.hidden_states[i][0] for i in layer_ids]
    return torch.stack(picked, dim=1), int(torch.argmax(out.logits[0, -1]))
