"""Local hidden-state generation vs a bare transformers forward over the same rows.

    .venv/bin/python benchmarks/bench_hidden_states.py [--conversations 400] [--json out.json]

Ours: dspark_kit.stages.hidden.hidden_states.generate_offline (load verifier, one forward per
group of equal-length rows, pick the exported layers in vLLM's convention, bf16,
validate-or-skip, a safetensors file per row). Baseline: load the same model with
transformers and run `model.model(ids, output_hidden_states=True)` row by row (the
plain loop) over the same rows, stacking the same layers, writing nothing. Both include model load; --repeats interleaved pairs, the
median per-pair ratio (and its range) is reported.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from common import Row, cli, emit, paired_ratios, spread, this_command

GOAL = 0.9


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    from dspark_kit.data.tiny_corpus import conversations
    from dspark_kit.data.tiny_verifier import ensure_tiny_verifier
    from dspark_kit.recipe import load_recipe
    from dspark_kit.stages.dataset.prepare import prepare
    from dspark_kit.stages.hidden.hidden_states import generate_offline

    torch.set_num_threads(torch.get_num_threads())
    vp = str(ensure_tiny_verifier())
    recipe = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml")
    with tempfile.TemporaryDirectory() as d:
        prepared = Path(d) / "prepared"
        rows = [{"messages": m} for m in conversations(args.conversations, seed=2, max_turns=2)]
        prepare(rows, vp, prepared, seq_length=recipe.data.seq_length, thinking=False)
        data = load_from_disk(str(prepared))
        all_ids = [torch.as_tensor(x, dtype=torch.long) for x in data["input_ids"]]
        tokens = sum(len(x) for x in all_ids)
        n_layers = 4
        layer_ids = recipe.exported_layer_ids(n_layers)

        def ours() -> float:
            shutil.rmtree(prepared / "hidden_states", ignore_errors=True)
            t0 = time.perf_counter()
            s = generate_offline(prepared, vp, layer_ids, device="cpu", dtype="float32", out_dtype="bfloat16",
                                 log=lambda _m: None)
            assert s.generated == len(all_ids), s
            return time.perf_counter() - t0

        def bare(write: bool = False) -> float:
            from safetensors.torch import save_file

            t0 = time.perf_counter()
            # read the rows from the prepared dir like generate_offline does: same fixed costs
            rows = [torch.as_tensor(x, dtype=torch.long) for x in load_from_disk(str(prepared))["input_ids"]]
            model = AutoModelForCausalLM.from_pretrained(vp, dtype=torch.float32).eval()
            with torch.inference_mode():
                for i, ids in enumerate(rows):
                    hs = model.model(input_ids=ids[None], output_hidden_states=True, use_cache=False).hidden_states
                    t = torch.stack([hs[k][0] for k in layer_ids], dim=1).to(torch.bfloat16)
                    if write:
                        save_file({"hidden_states": t.contiguous(), "token_ids": ids}, str(Path(d) / f"bare_{i}.st"))
            return time.perf_counter() - t0

        bare()  # warm the page cache and the allocator for both sides
        main = paired_ratios(bare, ours, args.repeats)
        written = paired_ratios(lambda: bare(write=True), ours, args.repeats)
    o, b, bw = main["subject_s"], main["baseline_s"], written["baseline_s"]
    ratio = main["ratio"]
    emit([
        Row("hidden-states", "bare transformers forward", tokens / b, "tok/s", notes=f"{len(all_ids)} rows, {tokens:,} tokens, no writes"),
        Row("hidden-states", "bare forward + the same files written inline", tokens / bw, "tok/s",
            notes="diagnostic: how much of the gap is the writing itself"),
        Row("hidden-states", "generate_offline", tokens / o, "tok/s",
            notes=f"layers {layer_ids}, bf16 files written; rows of one length share a forward"),
        Row("hidden-states", "generate_offline / bare forward", ratio, "x", f">= {GOAL}x", ratio >= GOAL,
            notes=f"throughput ratio, {spread(main)}; model load and reading the prepared rows included on both sides"),
        Row("hidden-states", "generate_offline / (bare forward + writes)", written["ratio"], "x",
            notes=f"1x = no overhead beyond writing the files; {spread(written)}"),
    ], args.json, this_command("bench_hidden_states.py", f"--conversations {args.conversations}"))


if __name__ == "__main__":
    main()
