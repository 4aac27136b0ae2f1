"""What a vLLM server holding the verifier needs on each of its devices, from config.json alone:
its weights, its KV cache and a runtime margin (plain values in, terms out; the resolver's memory
plan compares them with the device).

- **Weights per device.** Every parameter is loaded (every expert of an MoE). Tensor parallelism
  splits the attention heads, the MLP, the experts (tensor or expert parallel: either way over the
  TP ranks) and the vocabulary-parallel embedding and head; what vLLM replicates on every rank is
  counted whole: MLA's latent down-projections (q_a_proj, kv_a_proj_with_mqa: `disable_tp`) and
  the MoE router. Bytes per weight are the config's: a `quantization_config` (fp8 1 B plus its
  block scales, mxfp4's 4.25 bits on experts, awq/gptq/compressed-tensors bits) for the linear
  layers, the model dtype for the embeddings, head and anything unquantized.
- **KV cache per token and device.** Standard attention: 2 x KV heads per rank (ceil(kv / TP):
  replicated when there are fewer KV heads than ranks) x head_dim, per attention layer. MLA
  (`kv_lora_rank`): one latent of kv_lora_rank + qk_rope_head_dim per layer, whole on every rank.
  Hybrid models (`layer_types`): linear-attention layers keep a fixed state, no per-token cache;
  sliding-window layers hold at most `sliding_window` tokens. A config that lists no layer_types
  is counted as full attention in every layer (an upper bound for Gemma-3, whose class derives
  interleaved sliding layers from a pattern). The cache is in the model dtype
  (vLLM's kv_cache_dtype auto).
- **Runtime margin.** The device context (1 GiB, assumed) plus one forward's activations over
  the tokens of a step (hidden states and the MLP's intermediate per rank, assumed 2 live copies).
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_kit.specdec.verifier_facts import language_model_config, param_count

GIB = 1024**3
CONTEXT = GIB  # CUDA/CANN context, graphs and allocator slack (assumed, not measured)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    formula: str


def _i(c: dict, *keys: str, default: int = 0) -> int:
    for k in keys:
        v = c.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def quantized_bytes(cfg: dict, dtype: str) -> tuple[float, bool, str]:
    """(bytes per quantized weight, experts only?, how it was read) from the config's quantization_config;
    none: the model dtype."""
    q = cfg.get("quantization_config") or language_model_config(cfg).get("quantization_config")
    base = DTYPE_BYTES.get(dtype, 2)
    if not isinstance(q, dict):
        return base, False, f"{dtype} {base} B"
    method = str(q.get("quant_method") or "?").lower()
    if method == "fp8":
        block = q.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
            per = 1 + 4 / (block[0] * block[1])  # a float32 scale per block
            return per, False, f"fp8 1 B + a float32 scale per {block[0]}x{block[1]} block"
        return 1.0, False, "fp8 1 B"
    if method == "mxfp4":
        return 4.25 / 8, True, "mxfp4 4.25 bits (4-bit values, an 8-bit scale per 32) on the experts"
    bits = q.get("bits") or q.get("w_bit") or q.get("weight_bits")
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        bits = next((g.get("weights", {}).get("num_bits") for g in groups.values() if isinstance(g, dict)), None)
    if method == "bitsandbytes":
        bits = 4 if q.get("load_in_4bit") else 8 if q.get("load_in_8bit") else None
    if isinstance(bits, int) and 1 <= bits <= 16:
        return bits / 8, False, f"{method} {bits} bits"
    return base, False, f"quantization {method} not understood: counted at {dtype} {base} B"


def weight_parts(cfg: dict, dtype: str, tp: int) -> tuple[int, list[str]]:
    """(weight bytes on each of `tp` ranks, the formula's lines)."""
    c = language_model_config(cfg)
    h, layers, vocab = _i(c, "hidden_size"), _i(c, "num_hidden_layers"), _i(c, "vocab_size")
    heads = _i(c, "num_attention_heads", default=1)
    kv = _i(c, "num_key_value_heads", default=heads)
    hd = _i(c, "head_dim") or h // max(1, heads)
    inter = _i(c, "intermediate_size", default=4 * h)
    base = DTYPE_BYTES.get(dtype, 2)
    qb, experts_only, qhow = quantized_bytes(cfg, dtype)
    lin = base if experts_only else qb
    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3, Kimi): latent projections replicated, the rest split
        r, rope = _i(c, "kv_lora_rank"), _i(c, "qk_rope_head_dim")
        nope, v = _i(c, "qk_nope_head_dim"), _i(c, "v_head_dim", default=hd)
        qr = _i(c, "q_lora_rank")
        q_split = (qr * heads * (nope + rope)) if qr else h * heads * (nope + rope)
        replicated = (h * qr if qr else 0) + h * (r + rope)
        split = q_split + r * heads * (nope + v) + heads * v * h
        attn = f"MLA: {replicated:,} replicated + {split:,} split"
    else:
        # q and o split by heads; k and v by kv heads, each rank holding at least one (ceil(kv / TP))
        replicated, split = 0, 2 * h * hd * heads + 2 * h * hd * -(-kv // tp) * tp
        attn = f"{heads} heads x {hd} ({kv} kv)"
    experts = _i(c, "num_experts", "n_routed_experts", "num_local_experts")
    moe = _i(c, "moe_intermediate_size", default=inter)
    shared = _i(c, "shared_expert_intermediate_size") or moe * _i(c, "n_shared_experts")
    dense_layers = min(layers, _i(c, "first_k_dense_replace")) if experts else layers
    sparse_layers = layers - dense_layers
    expert_params = sparse_layers * experts * 3 * h * moe
    other_mlp = dense_layers * 3 * h * inter + sparse_layers * 3 * h * shared
    router = sparse_layers * h * experts
    tied = c.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    embed = (1 if tied else 2) * vocab * h
    vision = _vision_params(cfg)
    per_rank = (layers * (replicated * lin + split * lin / tp) + other_mlp * lin / tp + expert_params * qb / tp
                + router * base + embed * base / tp + vision * base / tp)
    total = param_count(cfg)
    lines = [f"{total:,} parameters, every expert" if experts else f"{total:,} parameters"] if total else []
    lines += [f"attention {layers} layers ({attn}) x {lin:g} B", f"MLP {other_mlp:,} x {lin:g} B / TP {tp}"]
    if experts:
        lines.append(f"experts {sparse_layers} layers x {experts} x 3 x {h} x {moe} = {expert_params:,} x {qb:g} B "
                     f"/ TP {tp}; router {router:,} x {base} B replicated")
    lines.append(f"embedding{'' if tied else ' + head'} {embed:,} x {dtype} {base} B / TP {tp}")
    if vision:
        lines.append(f"vision tower ~{vision:,} (vision_config: layers x (4 h^2 + 2 h x intermediate)) x {base} B / TP {tp}")
    lines.append(f"linear weights: {qhow}")
    return int(per_rank), lines


def _vision_params(cfg: dict) -> int:
    """A multimodal wrapper's vision tower (vLLM loads it with the LM), roughly: its transformer layers."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict) or cfg.get("text_config") is None:
        return 0
    h, n, inter = _i(v, "hidden_size"), _i(v, "num_hidden_layers", "depth"), _i(v, "intermediate_size")
    return n * (4 * h * h + 2 * h * inter) if h and n else 0


def kv_per_token(cfg: dict, dtype: str, tp: int, max_model_len: int) -> tuple[float, str]:
    """(KV-cache bytes per token of a max_model_len sequence, on one rank; the formula)."""
    c = language_model_config(cfg)
    layers = _i(c, "num_hidden_layers")
    base = DTYPE_BYTES.get(dtype, 2)
    types = c.get("layer_types") if isinstance(c.get("layer_types"), list) else None
    window = _i(c, "sliding_window")
    full = sum(1 for t in types if t in ("full_attention", "attention")) if types else layers
    sliding = sum(1 for t in types if t in ("sliding_attention", "chunked_attention")) if types else 0
    linear = len(types) - full - sliding if types else 0
    slide_frac = min(1.0, window / max_model_len) if window else 1.0
    eff = full + sliding * slide_frac
    if c.get("kv_lora_rank"):
        per = _i(c, "kv_lora_rank") + _i(c, "qk_rope_head_dim")
        how = f"MLA latent ({_i(c, 'kv_lora_rank')} + rope {_i(c, 'qk_rope_head_dim')}) x {base} B, whole on every rank"
    else:
        heads = _i(c, "num_attention_heads", default=1)
        kv = _i(c, "num_key_value_heads", default=heads)
        hd = _i(c, "head_dim") or _i(c, "hidden_size") // max(1, heads)
        per = 2 * -(-kv // tp) * hd
        how = f"2 x {-(-kv // tp)} kv heads per rank (of {kv}) x head_dim {hd} x {base} B"
    which = f"{full} attention layers" if not types else (
        f"{full} full-attention layers" + (f" + {sliding} sliding ({window} of {max_model_len} tokens)" if sliding else "")
        + (f" ({linear} linear-attention layers keep a fixed state)" if linear else ""))
    return eff * per * base, f"{which} x {how}"


def server_parts(cfg: dict, dtype: str, tp: int, max_model_len: int, seqs: int, device_kind: str) -> list[Part]:
    """Weights, KV cache for `seqs` sequences of max_model_len, and the runtime margin, on one rank."""
    weights, wlines = weight_parts(cfg, dtype, tp)
    per_token, khow = kv_per_token(cfg, dtype, tp, max_model_len)
    tokens = max_model_len * seqs
    c = language_model_config(cfg)
    h = _i(c, "hidden_size")
    inter = max(_i(c, "intermediate_size"), _i(c, "moe_intermediate_size") * _i(c, "num_experts_per_tok"))
    step = min(max_model_len, 8192)  # vLLM's default max_num_batched_tokens bound for one forward
    act = 2 * step * (4 * h + 2 * inter // tp) * DTYPE_BYTES.get(dtype, 2)
    margin = (CONTEXT if device_kind != "cpu" else 0) + act
    return [Part("verifier weights", weights, "; ".join(wlines)),
            Part("KV cache", int(per_token * tokens),
                 f"{seqs} sequence(s) x max_model_len {max_model_len} x {per_token:,.0f} B/token ({khow})"),
            Part("runtime margin", margin, f"context {CONTEXT // GIB} GiB (assumed) + activations of {step} tokens "
                                           f"x (4 x hidden {h} + 2 x {inter} / TP) x 2 copies x {dtype}")]
