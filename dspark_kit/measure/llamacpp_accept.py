"""Acceptance and throughput as llama.cpp's server counts them, beside the kit's in-process decoder.

Both sides decode the same token-id prompts (the verifier's chat template applied once, here),
greedy or sampled, for the same K:

- served: llama-server's native `/completion` with the prompt as token ids (no template or BOS
  added by the server), one request at a time. Acceptance comes from the server's own counters: the
  `/metrics` deltas of `llamacpp:spec_decode_num_drafts_total` (verification steps) and
  `..._num_accepted_tokens_total` (engines/prom.py reads them under vLLM's names), cross-checked
  with each response's `timings.draft_n` / `draft_n_accepted`. Throughput is generated tokens over
  the server's own generation time (`timings.predicted_ms`, prompt processing excluded) and over
  wall time.
- in-process: specdec/decoder.py's SpecGenerator on the verifier's HF folder (float32) and the
  checkpoint, the same prompts, K and max tokens.

Acceptance length = 1 + accepted / verification steps on both sides (specdec/acceptance.py).
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PromptSet:
    """Token-id prompts and how long to decode them."""

    ids: list[list[int]]
    max_new_tokens: int


def chat_prompt_ids(verifier_dir: str | Path, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn in the verifier's chat template, as token ids (generation prompt added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    out = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def _get(url: str, timeout: float = 60) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def served(base_url: str, prompts: PromptSet, temperature: float = 0.0, seed: int = 0,
           stop_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """Decode `prompts` on a running llama-server: its counters' acceptance and its generation throughput."""
    from dspark_kit.engines.prom import spec_decode_delta

    before = _get(base_url + "/metrics")
    gen_tokens, gen_ms, draft_n, draft_acc = 0, 0.0, 0, 0
    texts: list[list[int]] = []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts.ids):
        body = {"prompt": ids, "n_predict": prompts.max_new_tokens, "temperature": temperature,
                "seed": seed + i, "cache_prompt": False, "return_tokens": True, "top_k": 0, "top_p": 1.0,
                "min_p": 0.0}
        out = _post(base_url + "/completion", body)
        t = out.get("timings") or {}
        gen_tokens += int(t.get("predicted_n", 0))
        gen_ms += float(t.get("predicted_ms", 0.0))
        draft_n += int(t.get("draft_n", 0))
        draft_acc += int(t.get("draft_n_accepted", 0))
        texts.append(list(out.get("tokens") or []))
    wall = time.perf_counter() - t0
    spec = spec_decode_delta(before, _get(base_url + "/metrics"))
    return {"acceptance": spec, "timings_draft_n": draft_n, "timings_draft_n_accepted": draft_acc,
            "generated_tokens": gen_tokens, "generation_s": gen_ms / 1000.0, "wall_s": wall,
            "tokens_per_s": gen_tokens / (gen_ms / 1000.0) if gen_ms > 0 else None,
            "tokens": texts}


def in_process(verifier_dir: str | Path, checkpoint: str | Path, prompts: PromptSet, k: int,
               temperature: float = 0.0, seed: int = 0, stop_ids: frozenset[int] = frozenset()) -> dict[str, Any]:
    """The kit's decoder on the same prompts: acceptance (vLLM semantics) and the tokens it produced."""
    from dspark_kit.specdec.acceptance import acceptance
    from dspark_kit.specdec.decoder import SpecGenerator

    gen = SpecGenerator.from_checkpoint(verifier_dir, checkpoint, k)
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * k
    texts = []
    for i, ids in enumerate(prompts.ids):
        r = gen.generate(ids, prompts.max_new_tokens, temperature, seed=seed + i, stop_ids=stop_ids)
        drafts, draft_tokens, accepted = drafts + r.num_drafts, draft_tokens + r.num_draft_tokens, accepted + r.num_accepted_tokens
        per_pos = [a + b for a, b in zip(per_pos, r.accepted_per_pos, strict=False)]
        texts.append(r.token_ids)
    return {"acceptance": acceptance(drafts, draft_tokens, accepted, per_pos).as_dict(4), "tokens": texts}


def gate_line(served_al: float | None, in_process_al: float, minimum_fraction: float, what: str) -> str | None:
    """One line when the served draft accepts below `minimum_fraction` of what it accepts in-process; None when it holds.

    Compared on the tokens accepted per verification step (acceptance length - 1), not on the acceptance
    length itself: the length has a floor of 1, so for a weak draft (AL 1.15) even a draft that accepts
    nothing would keep 0.87 of it, and a fault could never fall below a fraction of the length."""
    if served_al is None:
        return f"{what}: llama.cpp reported no speculative steps (no draft served?)"
    if in_process_al <= 1.0:
        return f"{what}: the in-process decoder accepts nothing (acceptance length {in_process_al:.3f}); nothing to compare"
    fraction = (served_al - 1.0) / (in_process_al - 1.0)
    if fraction >= minimum_fraction:
        return None
    return (f"{what}: served {served_al - 1:.3f} accepted tokens per step (acceptance length {served_al:.3f}) is "
            f"{fraction:.2f}x the in-process {in_process_al - 1:.3f} (minimum {minimum_fraction}): the GGUF draft does "
            "not decode as the checkpoint does (check sample_from_anchor, the Markov head and the target layers in the export)")
