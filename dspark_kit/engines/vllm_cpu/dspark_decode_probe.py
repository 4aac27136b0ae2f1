"""vLLM's own DSpark code decodes with a checkpoint on the CPU: run with vLLM's python.

    python dspark_decode_probe.py --verifier V --checkpoint CKPT --k K --prompts P.json --out T.pt

For each prompt (token ids), greedy speculative decoding one request at a time, with vLLM's code
for every DSpark step:
- the verifier: vLLM's model from `get_model`, aux hidden states at the layers
  `set_eagle3_aux_hidden_state_layers` picks from the draft config, logits from `compute_logits`;
- the draft: `DSparkSpeculator` (its `__init__` and `load_model`, i.e. `load_dspark_model` and
  `Qwen3DSparkForCausalLM`), its prepare kernel `_prepare_dflash_inputs_kernel`, the context K/V
  precompute `_precompute_context_kv`, the query-block forward `_run_model` on the CPU attention
  backend, and the sequential Markov sampling `_sample_sequential` / `_sample_sequential_topk`;
- verification: greedy against the verifier's logits (longest matching prefix plus one token).

What `propose` adds around those steps (batching, CUDA graphs, DP sync) is not run: one request,
eager. Every change needed to run on the CPU is in PATCHES and printed with the result. A vLLM
whose functions moved prints one line naming what is missing (`incompatible`), not a traceback.

Writes a torch file (the trace: per prompt, per step, what vLLM drafted and saw) and prints one
JSON line (vLLM's version, the patches, the layout it drafted with, or `failed`). Imports only
vllm, torch, triton and the contract probe beside it: never part of dspark_kit.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton loads: the prepare kernel runs in Triton's interpreter
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import argparse
import contextlib
import json
import sys
import traceback
import types

BLOCK = 32  # the CPU attention backend's KV block size: a multiple of 32
PATCHES = [
    ("vllm.v1.worker.cpu_model_runner._set_torch_accelerator_to_noop",
     "called first, as vLLM's CPU runner does: torch.accelerator calls become no-ops"),
    ("vllm.config.vllm.HAS_TRITON",
     "set True for create_engine_config: the V2 runner (the only one with DSpark) asks for Triton"),
    ("vllm.v1.worker.gpu.spec_decode.dflash.speculator._prepare_dflash_inputs_kernel",
     "re-wrapped with triton.jit under TRITON_INTERPRET=1 (with cp_utils.cp_local_slot): the CPU build's Triton has no CPU backend, so vLLM left it a plain function"),
    ("vllm.v1.worker.gpu.spec_decode.dflash.speculator.triton",
     "the real triton module (vLLM's placeholder lacks next_power_of_2, used by prepare_dflash_inputs)"),
    ("Attention.kv_cache (every target and draft layer)",
     f"bound by hand: CPU caches of {BLOCK}-token blocks, block 0 left as vLLM's null block"),
    ("vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder",
     "built directly per layer group (target causal, draft non-causal) instead of by set_attn; its constructor sets layer.isa, which the context K/V write needs"),
    ("DSparkSpeculator._sample_logits",
     "wrapped to record each slot's logits; at a temperature the Triton gumbel sampler is replaced by a seeded torch draw (the check compares candidates and logits, not the RNG)"),
    ("DSparkSpeculator.use_confidence_head",
     "set True when the draft has a confidence head, so compute_confidence runs (vLLM only runs it with enable_adaptive_verification)"),
]
KNORM_PATCH = ("vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model._normalize_context_k",
               "per-layer ops.rms_norm: the CPU kernel applies row 0 of the grouped [L, head_dim] k_norm weight to every layer (drafts of 2+ layers were normalized wrongly)")
FAULTS = ("sample-from-anchor", "markov-zero", "mask-token", "aux-layers", "confidence-no-markov")


class Incompatible(RuntimeError):
    """This vLLM lacks a function the harness drives: one line naming it."""


def _need(module: str, *names: str):
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise Incompatible(f"{module}: cannot import ({e})") from None
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise Incompatible(f"{module} has no {', '.join(missing)}")
    return mod if len(names) != 1 else getattr(mod, names[0])


def _has(obj, *names: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise Incompatible(f"{getattr(obj, '__name__', type(obj).__name__)} has no {', '.join(missing)}")


def _interpreted(fn, tl, triton):
    """A plain function (vLLM's Triton placeholder returns the undecorated kernel) as a Triton
    interpreter kernel: its globals see the real triton.language, its constexpr annotations too."""
    glb = dict(fn.__globals__, tl=tl, triton=triton)
    new = types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__annotations__ = {k: (tl.constexpr if callable(v) and getattr(v, "__name__", "") == "<lambda>" else v)
                           for k, v in fn.__annotations__.items()}
    new.__module__, new.__qualname__, new.__wrapped__ = fn.__module__, fn.__qualname__, fn
    return new, glb


def patch_prepare_kernel() -> None:
    import triton
    import triton.language as tl

    dflash = _need("vllm.v1.worker.gpu.spec_decode.dflash.speculator", "_prepare_dflash_inputs_kernel",
                   "prepare_dflash_inputs", "DFlashSpeculator")
    cp_local_slot = _need("vllm.v1.worker.gpu.cp_utils", "cp_local_slot")
    kernel = dflash._prepare_dflash_inputs_kernel
    raw = getattr(kernel, "fn", kernel)
    raw = getattr(raw, "__wrapped__", raw)
    cp_raw = getattr(cp_local_slot, "fn", cp_local_slot)
    cp_fn, _ = _interpreted(getattr(cp_raw, "__wrapped__", cp_raw), tl, triton)
    fn, glb = _interpreted(raw, tl, triton)
    glb["cp_local_slot"] = triton.jit(cp_fn)
    dflash._prepare_dflash_inputs_kernel = triton.jit(fn)
    dflash.triton = triton


def per_layer_k_norm(inner) -> None:
    """The workaround: each layer's K normalized with its own row of the grouped k_norm weight."""
    import torch
    from vllm import _custom_ops as ops

    def normalize(all_k):
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i].contiguous(), inner._k_norm_weights[i].contiguous(),
                         inner._rms_norm_eps)
        return out

    inner._normalize_context_k = normalize


class Harness:
    """One verifier and one DSpark speculator, built by vLLM on the CPU, decoding one request."""

    def __init__(self, verifier: str, ckpt: str, k: int, max_model_len: int, knorm_workaround: bool):
        import torch

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import dspark_contract_probe as contract

        _need("vllm.v1.worker.cpu_model_runner", "_set_torch_accelerator_to_noop")()
        patch_prepare_kernel()
        self.torch = torch
        # one request: small batch buffers keep the interpreted prepare kernel's padding loops short
        self.cfg = contract.engine_config(ckpt, verifier, k, max_model_len, max_num_seqs=1,
                                          max_num_batched_tokens=max_model_len)
        from vllm.config import set_current_vllm_config

        self._ctx = set_current_vllm_config(self.cfg)
        self._ctx.__enter__()
        contract._one_process_group(self.cfg)
        torch.set_default_dtype(torch.float32)
        get_model = _need("vllm.model_executor.model_loader", "get_model")
        set_aux = _need("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils", "set_eagle3_aux_hidden_state_layers")
        DSparkSpeculator = _need("vllm.v1.worker.gpu.spec_decode.dspark.speculator", "DSparkSpeculator")
        _has(DSparkSpeculator, "load_model", "_sample_sequential", "_sample_sequential_topk", "_sample_logits",
             "_run_model", "_precompute_context_kv", "attn_vllm_config")
        self.target = get_model(vllm_config=self.cfg)
        set_aux(self.target, self.cfg.speculative_config)
        self.aux_layers = list(self.target.model.aux_hidden_state_layers)
        self.spec = spec = DSparkSpeculator(self.cfg, torch.device("cpu"))
        spec.load_model(self.target)
        self.model, inner = spec.model, spec.model.model
        _has(inner, "_normalize_context_k", "_k_norm_weights", "precompute_and_store_context_kv")
        self.patches = [list(p) for p in PATCHES]
        if knorm_workaround:
            per_layer_k_norm(inner)
            self.patches.append(list(KNORM_PATCH))
        self.k = spec.num_speculative_steps
        self._bind_caches()
        self._wrap_recorders()

    # ---- set-up --------------------------------------------------------------------------
    @contextlib.contextmanager
    def planted(self, fault: str):
        """A fault the kit's tests plant in vLLM's path (each to be found by the comparison), undone after."""
        spec, inner, torch = self.spec, self.model.model, self.torch
        saved = (spec.sample_from_anchor, spec.num_query_per_req, spec._anchor_idx, spec.parallel_drafting_token_id)
        w1 = inner.markov_head.markov_w1.weight.data.clone()
        head = inner.confidence_head
        aux = tuple(self.aux_layers)
        if fault == "sample-from-anchor":  # the other block layout: 1 + K query tokens, the anchor not sampled
            spec.sample_from_anchor = not spec.sample_from_anchor
            spec.num_query_per_req = self.k if spec.sample_from_anchor else self.k + 1
            spec._anchor_idx = torch.arange(spec.max_num_reqs) * spec.num_query_per_req
        elif fault == "markov-zero":  # W1[prev] = 0: no Markov bias (and a zero Markov embedding)
            inner.markov_head.markov_w1.weight.data.zero_()
        elif fault == "mask-token":
            spec.parallel_drafting_token_id += 1
        elif fault == "aux-layers":  # the verifier exports the layers one later
            self.target.set_aux_hidden_state_layers(tuple(i + 1 for i in aux))
        elif fault == "confidence-no-markov" and head is not None:
            forward = head.forward
            head.forward = lambda hidden, markov: forward(hidden, torch.zeros_like(markov))
        try:
            yield {"sample_from_anchor": bool(spec.sample_from_anchor), "num_query_per_req": spec.num_query_per_req,
                   "mask_token_id": spec.parallel_drafting_token_id,
                   "aux_layers": list(self.target.model.aux_hidden_state_layers)}
        finally:
            (spec.sample_from_anchor, spec.num_query_per_req, spec._anchor_idx,
             spec.parallel_drafting_token_id) = saved
            inner.markov_head.markov_w1.weight.data.copy_(w1)
            self.target.set_aux_hidden_state_layers(aux)
            if head is not None and "forward" in head.__dict__:
                del head.forward

    def _bind_caches(self) -> None:
        torch = self.torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        builder_cls = _need("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder")
        layers = self.cfg.compilation_config.static_forward_context
        draft_names = sorted(self.spec.draft_attn_layer_names)
        target_names = sorted(n for n in layers if n not in self.spec.draft_attn_layer_names)
        self.num_blocks = self.cfg.model_config.max_model_len // BLOCK + 2
        self.block_table = torch.arange(1, self.num_blocks, dtype=torch.int32)  # block 0: the null block
        for name in [*target_names, *draft_names]:
            layer = layers[name]
            layer.kv_cache = torch.zeros(self.num_blocks + 1, layer.num_kv_heads, BLOCK, 2 * layer.head_size)
        self.groups = {}
        for key, names, vcfg in (("target", target_names, self.cfg), ("draft", draft_names, self.spec.attn_vllm_config)):
            first = layers[names[0]]
            kv_spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=first.num_kv_heads,
                                        head_size=first.head_size, dtype=torch.float32)
            self.groups[key] = (names, builder_cls(kv_spec, names, vcfg, torch.device("cpu")))
        spec = self.spec
        spec._context_slot_mappings = torch.zeros(1, spec.max_num_tokens, dtype=torch.int64)
        spec._layer_group_idx = None
        self.query_slots = torch.zeros(spec.max_num_tokens, dtype=torch.int64)

    def _wrap_recorders(self) -> None:
        spec, model, torch = self.spec, self.model, self.torch
        self.rec: dict = {}
        sample_logits = spec._sample_logits
        draw = torch.Generator().manual_seed(0)

        def recorded(logits, idx_map, sample_pos, step):
            self.rec.setdefault("logits", []).append(logits[0].detach().clone())
            if self.temperature is None:
                return sample_logits(logits, idx_map, sample_pos, step)
            p = torch.softmax(logits.float() / self.temperature, -1)
            return model.map_draft_to_target(torch.multinomial(p, 1, generator=draw)[:, 0])

        spec._sample_logits = recorded
        base = model.compute_draft_logits

        def base_logits(hidden):
            out = base(hidden)
            self.rec["base"] = out.detach().clone()
            return out

        model.compute_draft_logits = base_logits
        inner = model.model
        normalize = inner._normalize_context_k

        def normalized(all_k):
            out = normalize(all_k)
            self.rec["context_k"] = out.detach().clone()  # [L, n, kv heads, head_dim], before RoPE
            return out

        inner._normalize_context_k = normalized
        spec.use_confidence_head = inner.confidence_head is not None
        self.temperature = None

    # ---- one forward each --------------------------------------------------------------
    def _metadata(self, group: str, qsl, seq_lens, slots, causal: bool, num_tokens: int):
        torch = self.torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        names, builder = self.groups[group]
        seq = int(seq_lens[0])
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=1,
            num_actual_tokens=num_tokens, max_query_len=int(qsl[1] - qsl[0]), max_seq_len=seq,
            block_table_tensor=self.block_table[None].clone(), slot_mapping=slots, causal=causal,
            positions=None, seq_lens_cpu_upper_bound=seq_lens.clone(),
            is_prefilling=torch.zeros(1, dtype=torch.bool))
        md = builder.build(0, common)
        return {n: md for n in names}, {n: slots for n in names}

    def _slots(self, pos):
        return (self.block_table.long()[pos // BLOCK] * BLOCK + pos % BLOCK).long()

    def verify(self, ids: list[int]):
        """vLLM's verifier over the whole sequence (causal prefill): logits [n, V] and aux [n, L*H]."""
        torch = self.torch
        from vllm.forward_context import set_forward_context

        n = len(ids)
        pos = torch.arange(n)
        md, slots = self._metadata("target", torch.tensor([0, n], dtype=torch.int32),
                                   torch.tensor([n], dtype=torch.int32), self._slots(pos), True, n)
        with torch.inference_mode(), set_forward_context(md, self.cfg, num_tokens=n, slot_mapping=slots):
            hidden, aux = self.target(input_ids=torch.tensor(ids), positions=pos)
            logits = self.target.compute_logits(hidden)
        return logits.float(), [a.float() for a in aux]

    def propose(self, aux: list, positions: list[int], num_rejected: int, bonus: int) -> dict:
        """One DSpark draft step for the verified tokens at `positions` (the last `num_rejected`
        rejected), the bonus token `bonus` as the anchor: what vLLM drafts and what it saw."""
        import numpy as np

        torch, spec = self.torch, self.spec
        dflash = sys.modules["vllm.v1.worker.gpu.spec_decode.dflash.speculator"]
        n = len(positions)
        valid = n - num_rejected  # the rows whose K/V vLLM writes (rejected rows go to PAD slots)
        self.rec = {}
        with torch.inference_mode():
            hidden = self.model.combine_hidden_states(torch.cat(aux, dim=-1))
            spec.hidden_states[:n].copy_(hidden)
            batch = types.SimpleNamespace(
                num_reqs=1, num_tokens=n, num_scheduled_tokens=np.array([n]),
                positions=torch.tensor(positions, dtype=torch.int64),
                query_start_loc=torch.tensor([0, n], dtype=torch.int32), idx_mapping=torch.tensor([0], dtype=torch.int32))
            last = torch.zeros(spec.max_num_reqs, dtype=torch.int64)
            last[0] = bonus
            zeros = torch.zeros(spec.max_num_reqs)
            dflash.prepare_dflash_inputs(
                spec.input_buffers, self.query_slots, spec.context_positions, spec._context_slot_mappings[0],
                spec.sample_indices, spec.sample_pos, spec.sample_idx_mapping, spec.temperature, spec.seeds, batch,
                torch.tensor([1], dtype=torch.int32), torch.tensor([num_rejected], dtype=torch.int32), last,
                torch.zeros_like(last), zeros if self.temperature is None else zeros + self.temperature,
                torch.zeros(spec.max_num_reqs, dtype=torch.int64), self.block_table[None].clone(), BLOCK, 0, 1, 1,
                spec.parallel_drafting_token_id, spec.num_query_per_req, spec.num_speculative_steps,
                spec.max_num_reqs, spec.max_num_tokens, spec.max_model_len, spec.sample_from_anchor)
            q = spec.num_query_per_req
            qsl = spec.input_buffers.query_start_loc[:2].clone()
            seq_lens = spec.input_buffers.seq_lens[:1].clone()
            md, slots = self._metadata("draft", qsl, seq_lens, self.query_slots[:q].clone(),
                                       not spec.requires_non_causal, q)
            spec._precompute_context_kv(0, n)  # writes the context K/V with each layer's isa
            head = spec._run_model(q, md, slots, None)
            spec._sample_sequential(1, head)
        out = {"input_ids": spec.input_buffers.input_ids[:q].tolist(),
               "query_positions": spec.input_buffers.positions[:q].tolist(),
               "tokens": spec.draft_tokens[0].tolist(), "context": hidden[:valid].clone(),
               "context_k": None if self.rec.get("context_k") is None else self.rec["context_k"][:, :valid],
               "base": self.rec.get("base"),
               "logits": torch.stack(self.rec["logits"]) if self.rec.get("logits") else None,
               "confidence": (spec.draft_token_confidence_probs[0].tolist()
                              if spec.use_confidence_head else None)}
        return out

    # ---- decoding ------------------------------------------------------------------------
    def decode(self, prompt: list[int], max_new: int, stop_ids: set[int]) -> dict:
        """Greedy speculative decoding: the emitted tokens and every step's draft and verdict."""
        logits, aux = self.verify(prompt)
        anchor = int(logits[-1].argmax())
        out, steps = [anchor], []
        positions, rejected = list(range(len(prompt))), 0
        while len(out) < max_new and anchor not in stop_ids:
            seq = [*prompt, *out]
            step = self.propose([a[positions] for a in aux], positions, rejected, anchor)
            drafted = step["tokens"]
            logits, aux = self.verify([*seq, *drafted])
            target = logits[len(seq) - 1:].argmax(-1).tolist()
            n = 0
            while n < len(drafted) and drafted[n] == target[n]:
                n += 1
            step.update(context_len=len(seq) - 1, anchor=anchor, accepted=n,
                        verifier_top5=logits[len(seq) - 1: len(seq) - 1 + len(drafted)].topk(5, -1).indices.tolist())
            steps.append(step)
            positions, rejected, anchor = list(range(len(seq) - 1, len(seq) + len(drafted))), len(drafted) - n, target[n]
            emitted = [*drafted[:n], anchor]
            stop = next((i for i, t in enumerate(emitted) if t in stop_ids), None)
            out += emitted if stop is None else emitted[: stop + 1]
            if stop is not None:
                break
        return {"tokens": out[:max_new], "steps": steps}

    def sampled(self, prompt: list[int], temperature: float, topk: int | None) -> dict:
        """One sampled draft block at the prompt's context: the base logits and what vLLM's sequential
        sampler (top-k or not) offered each slot, with the tokens it drew."""
        self.temperature, self.spec._draft_topk = temperature, topk
        try:
            logits, aux = self.verify(prompt)
            step = self.propose(aux, list(range(len(prompt))), 0, int(logits[-1].argmax()))
        finally:
            self.temperature, self.spec._draft_topk = None, None
        return {"temperature": temperature, "topk": topk, "anchor": int(logits[-1].argmax()),
                "base": step["base"], "logits": step["logits"], "tokens": step["tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--prompts", required=True, help="JSON: a list of prompts (token id lists)")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--stop", type=int, action="append", default=[])
    ap.add_argument("--out", required=True, help="torch file for the trace")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--no-knorm-workaround", action="store_true")
    ap.add_argument("--fault", choices=FAULTS, action="append", default=[],
                    help="also decode with this fault planted in vLLM's path (the kit's tests)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--topk", type=int, action="append", default=[], help="sampled-drafting checks (0: none)")
    a = ap.parse_args()
    result: dict = {"checkpoint": a.checkpoint}
    try:
        import torch
        import vllm

        result["vllm"] = vllm.__version__
        h = Harness(a.verifier, a.checkpoint, a.k, a.max_model_len, not a.no_knorm_workaround)
        result.update(patches=h.patches, aux_layers=h.aux_layers, num_speculative_tokens=h.k,
                      sample_from_anchor=bool(h.spec.sample_from_anchor), mask_token_id=h.spec.parallel_drafting_token_id,
                      num_query_per_req=h.spec.num_query_per_req, draft_layers=len(h.model.model.layers))
        with open(a.prompts) as f:
            prompts = json.load(f)
        trace = {"decode": [h.decode(p, a.max_new, set(a.stop)) for p in prompts],
                 "sampled": [h.sampled(prompts[0], a.temperature, k or None) for k in a.topk], "faults": {}}
        for fault in a.fault:
            with h.planted(fault) as layout:
                trace["faults"][fault] = {**layout, "decode": [h.decode(p, a.max_new, set(a.stop)) for p in prompts]}
        torch.save(trace, a.out + ".part")
        os.replace(a.out + ".part", a.out)
    except Incompatible as e:
        result["incompatible"] = str(e)
    except Exception as e:  # noqa: BLE001 - the failure, in one line, is the result
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        result["failed"] = {"error": f"{type(e).__name__}: {lines[-1] if lines else ''}",
                            "traceback": traceback.format_exc()[-4000:]}
    json.dump(result, sys.stdout, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
