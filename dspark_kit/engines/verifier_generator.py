"""Verifier-only decoding and hidden-state extraction with transformers.

`VerifierGenerator` implements the `Generator` protocol (specdec/decoder.py):
greedy at temperature 0, seeded sampling otherwise, one KV cache per request.
`extract_hidden_states` reads aux states in vLLM's layer-id convention through
dspark_kit.specdec.verifier.LayerTap; loading the model is dspark_kit.specdec.verifier.load_verifier.
"""

from __future__ import annotations

import time

import torch

from dspark_kit.specdec.decoder import GenerationResult
from dspark_kit.specdec.verifier import LayerTap, sample_token


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
        cancel=None,
        on_tokens=None,
    ) -> GenerationResult:
        """`cancel` (a threading.Event): checked between decode steps; once set, stop with reason "abort".
        `on_tokens`: called with [token] as each token is decided (streaming)."""
        from transformers import DynamicCache

        gen = None
        if temperature > 0:
            gen = torch.Generator()
            gen.manual_seed(seed if seed is not None else int(time.time_ns() % 2**63))
        cache = DynamicCache()
        step_ids = torch.tensor([prompt_ids], device=self.device)
        out: list[int] = []
        while len(out) < max_new_tokens:
            if cancel is not None and cancel.is_set():
                return GenerationResult(out, "abort")  # the client went away: free the decoder
            logits = self.model(input_ids=step_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            token = sample_token(logits[0, -1], temperature, top_p, gen)
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            out.append(token)  # like vLLM (and decoder.py), the stop token is part of the output ids
            if on_tokens is not None:
                on_tokens([token])
            if token in stop_ids:
                return GenerationResult(out, "stop")
            step_ids = torch.tensor([[token]], device=self.device)
        return GenerationResult(out, "length")


@torch.inference_mode()
def extract_hidden_states(model, token_ids: list[int], layer_ids: list[int]) -> tuple[torch.Tensor, int]:
    """[seq, len(layer_ids), hidden] in vLLM's id convention, plus the greedy next token."""
    with LayerTap(model, layer_ids, field="--layer-ids") as tap:
        ids = torch.tensor([token_ids], device=next(model.parameters()).device)
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hs = tap.select(out.hidden_states)
    return hs, int(torch.argmax(out.logits[0, -1]))
