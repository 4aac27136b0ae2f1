"""vLLM's own code judges a DSpark checkpoint: run with the CPU build's python, prints one JSON object.

    python dspark_contract_probe.py --verifier VERIFIER --job CKPT:K [--job CKPT:K ...]

One JSON object per job, in job order (vLLM's import is most of the cost: one
process judges every checkpoint).

Three steps, each with vLLM's real code, none of which serves anything (the CPU
build has no DSpark runner: V1 lacks it, V2 needs Triton):
1. config: `vllm.transformers_utils.config.get_config(CKPT)` - what vLLM's
   speculators loader makes of config.json (architecture, anchor layout, block,
   aux layer ids, mask token).
2. engine config: `EngineArgs(VERIFIER, speculative_config=dspark/K)` ->
   `create_engine_config()`, with the V2 runner asked for and Triton's presence
   faked for this config step only (the check that needs it is about running).
3. weights: the architecture vLLM's registry maps the draft to, built on CPU in
   float32 under that config, and its `load_weights` fed every checkpoint tensor;
   an unknown name raises, and every parameter the tensors did not fill is
   reported (embedding and lm_head are shared from the verifier when absent,
   `mask_embedding` is a placeholder vLLM never reads).

Imports only vllm, torch and safetensors: this file is put on the CPU build's
path, never imported as part of dspark_kit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import traceback

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

CONFIG_ATTRS = ("architectures", "sample_from_anchor", "dspark_bonus_anchor", "block_size",
                "eagle_aux_hidden_state_layer_ids", "target_layer_ids", "mask_token_id",
                "draft_vocab_size", "enable_confidence_head")
SHARED_FROM_TARGET = ("embed_tokens", "lm_head", "mask_embedding")


def _error(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}".strip()


def read_config(ckpt: str) -> dict:
    from vllm.transformers_utils.config import get_config

    cfg = get_config(ckpt, trust_remote_code=False)
    return {a: getattr(cfg, a, None) for a in CONFIG_ATTRS}


def engine_config(ckpt: str, verifier: str, k: int, max_model_len: int, **engine_args):
    import vllm.config.vllm as vllm_config_module
    from vllm.engine.arg_utils import EngineArgs

    vllm_config_module.HAS_TRITON = True  # config only: nothing here runs a kernel
    args = EngineArgs(model=verifier, dtype="float32", enforce_eager=True, max_model_len=max_model_len,
                      speculative_config={"method": "dspark", "model": ckpt, "num_speculative_tokens": k},
                      **engine_args)
    return args.create_engine_config()


def _layout(vllm_cfg) -> dict:
    """How vLLM's runtime will draft: the anchor layout in the draft config its DSpark speculator
    reads (None: absent; the kit's specdec/anchor.py says how vLLM reads that), the KV lookahead it
    reserves (K with the anchor sampled, K + 1 without), and the verifier layers it exports to the draft."""
    spec = vllm_cfg.speculative_config
    out = {"sample_from_anchor": getattr(spec.draft_model_config.hf_config, "sample_from_anchor", None)}
    try:
        out["num_lookahead_tokens"] = vllm_cfg.num_lookahead_tokens
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
            get_eagle3_aux_layers_from_config,
        )

        layers = get_eagle3_aux_layers_from_config(spec)
        out["aux_layers"] = list(layers) if layers else None
    except (AttributeError, ImportError):  # an older vLLM: not reported
        pass
    return out


def _one_process_group(vllm_cfg) -> None:
    """vLLM's layers ask the tensor-parallel group for their shard: a group of one, made once."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    init_file = os.path.join(tempfile.mkdtemp(prefix="dspark-probe-"), "pg")
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"file://{init_file}", backend="gloo")
    initialize_model_parallel(1, 1)


# A reduced-vocabulary draft's d2t (draft id -> target id offsets, never negative) is an integer
# parameter: it cannot hold NaN, so an unreached one holds this
UNSET_ID = -1


def load_weights(vllm_cfg, ckpt: str) -> dict:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models import ModelRegistry

    draft = vllm_cfg.speculative_config.draft_model_config
    arch = draft.hf_config.architectures[0]
    cls, _ = ModelRegistry.resolve_model_cls([arch], model_config=draft)
    with set_current_vllm_config(vllm_cfg):
        _one_process_group(vllm_cfg)
        torch.set_default_dtype(torch.float32)
        model = cls(vllm_config=vllm_cfg, prefix="draft_model")
        params = dict(model.named_parameters())
        for p in params.values():  # NaN marks every parameter no checkpoint tensor reached; an integer
            p.data.fill_(float("nan") if p.data.is_floating_point() else UNSET_ID)  # one (d2t) gets UNSET_ID
        tensors = load_file(os.path.join(ckpt, "model.safetensors"))
        model.load_weights(iter(tensors.items()))
        after = dict(model.named_parameters())  # load_weights may drop heads the checkpoint lacks
    unloaded = sorted(n for n, p in after.items()  # fused: any shard
                      if (torch.isnan(p.data) if p.data.is_floating_point() else p.data == UNSET_ID).any())
    missing = [n for n in unloaded if not any(s in n for s in SHARED_FROM_TARGET)]
    digest = hashlib.sha256()  # what the checkpoint put into vLLM's parameters, name by name
    for name in sorted(n for n in after if n not in unloaded):
        digest.update(name.encode())
        digest.update(after[name].data.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return {"architecture": arch, "model_class": cls.__name__, "checkpoint_tensors": sorted(tensors),
            "parameters": len(after), "unloaded_shared": [n for n in unloaded if n not in missing],
            "missing": missing, "parameters_sha256": digest.hexdigest()}


def judge(ckpt: str, verifier: str, k: int, max_model_len: int) -> dict:
    out: dict = {"checkpoint": ckpt, "k": k}
    step = "config"
    try:
        out["config"] = read_config(ckpt)
        step = "engine_config"
        cfg = engine_config(ckpt, verifier, k, max_model_len)
        spec = cfg.speculative_config
        out["engine_config"] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                                **_layout(cfg)}
        step = "load_weights"
        out["load_weights"] = load_weights(cfg, ckpt)
    except Exception as e:  # noqa: BLE001 - the step that failed, in one line, is the result
        out["failed"] = {"step": step, "error": _error(e), "traceback": traceback.format_exc()[-4000:]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--job", action="append", required=True, metavar="CKPT:K")
    ap.add_argument("--max-model-len", type=int, default=512)
    a = ap.parse_args()
    import vllm

    results = []
    for job in a.job:
        ckpt, _, k = job.rpartition(":")
        results.append(judge(ckpt, a.verifier, int(k), a.max_model_len))
    json.dump({"vllm": vllm.__version__, "results": results}, sys.stdout, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
