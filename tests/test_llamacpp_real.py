"""llama.cpp serves a kit draft end to end: a SmolLM2-135M-Instruct draft trained here, exported with
llama.cpp's converter, served by `llama-server --spec-type draft-dspark`, accepts what the kit's
in-process decoder accepts; a flipped anchor layout fails the gate in one line, and a zeroed Markov
head accepts less (slow).

The draft: recipes/smollm2-135m-cpu.yaml run with serve.engine llama.cpp (regen on llama-server,
the verifier's Q4_1 GGUF, each reply keeping the server's own token ids; hidden states and training in-process on the dequantized HF folder) on
the six questions below, fitted to the verifier's replies (SETS says why), about two minutes. The
comparison decodes the same token-id prompts, greedy, at the same K, against an F16 GGUF of the
same HF folder (llama.cpp's converter), the target closest to the in-process float32 verifier.

Tolerance (MIN_FRACTION), on the tokens accepted per verification step (acceptance length - 1;
the length itself has a floor of 1, so a fault would hide in it for a weak draft): llama.cpp
computes in its own kernels (F16 weights, its own accumulation order), so the greedy target text
drifts from float32 transformers' after some tokens and both sides then measure acceptance on
slightly different continuations, which moves the figure by tens of percent either way at this
size. Measured on this fixture's draft (K 3): 0.394 accepted per step in-process, 0.507 served
(1.29x); sample_from_anchor flipped 0.185 (0.47x, caught); Markov head zeroed 0.476 (1.21x of
in-process, 0.94x of served: not caught by the gate, see the test).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.llamacpp_build import llama_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("llamacpp")]

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "smollm2-135m-cpu.yaml"
MIN_FRACTION = 0.7
QUESTIONS = ["What is the capital of France? Answer in one sentence.", "Why is the sky blue?",
             "List the planets of the solar system in order.", "How do I make a cup of tea?",
             "Give three tips for staying focused while studying.", "What is photosynthesis? Explain it simply."]
MAX_NEW = 48
# The draft learns the verifier's own greedy replies to QUESTIONS (64 tokens each, kept when cut) for
# 40 epochs and the last epoch serves: a draft fitted to the measured continuations accepts enough
# (1.39 to 1.48 in-process, K 3) for a layout fault to show; 64 general rows for 6 epochs accepted 1.08,
# where a flipped anchor layout still passed the gate at 0.77x. What is compared is the layout
# llama.cpp reads, not how the draft generalizes (eval and bench measure that).
SETS = ["serve.engine=llama.cpp", "draft.arch=qwen3", f"data.limit={len(QUESTIONS)}", "regen.max_tokens=64",
        "data.seq_length=192", "data.keep_truncated=true", "train.epochs=40", "train.max_anchors=64",
        "train.checkpoint_freq=20", "serve.checkpoint=latest"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(workdir, checkpoint, verifier HF folder, the verifier's own GGUF) of a SmolLM2 draft trained here."""
    llama_server()
    if not RECIPE.exists():
        pytest.skip(f"{RECIPE.name} not in this checkout (the SmolLM2 verifier recipe)")
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved

    wd = tmp_path_factory.mktemp("smollm2-llamacpp")
    source = wd / "questions.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS))
    sets = [*SETS, f"data.source={source}"]
    argv = [sys.executable, "-m", "dspark_kit", "run", str(RECIPE), "-w", str(wd), "--stages",
            "regen,prepare,hidden-states,train", *(x for s in sets for x in ("--set", s))]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = Resolved(load_recipe(RECIPE, sets), wd)
    return wd, res.checkpoint, Path(res.verifier_path), Path(res.verifier_gguf)


@pytest.fixture(scope="module")
def f16_target(trained, tmp_path_factory):
    """The verifier as F16 GGUF, converted once by llama.cpp's converter from the HF folder."""
    from dspark_kit.specdec.gguf_export import convert_with_llamacpp

    out = tmp_path_factory.mktemp("f16") / "verifier-f16.gguf"
    convert_with_llamacpp(trained[2], None, out, "f16", out.with_suffix(".log"))
    return out


def variant(ckpt: Path, dest: Path, *, flip_anchor: bool = False, zero_markov: bool = False) -> Path:
    """A copy of the checkpoint with one planted fault."""
    import torch
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True)
    cfg = json.loads((ckpt / "config.json").read_text())
    if flip_anchor:
        cfg["sample_from_anchor"] = not cfg["sample_from_anchor"]
    (dest / "config.json").write_text(json.dumps(cfg))
    if zero_markov:
        tensors = load_file(str(ckpt / "model.safetensors"))
        marked = [k for k in tensors if "markov" in k]
        assert marked, "the draft has no Markov head tensors"
        save_file({k: torch.zeros_like(v) if k in marked else v for k, v in tensors.items()},
                  str(dest / "model.safetensors"), metadata={"format": "pt"})
    else:
        shutil.copyfile(ckpt / "model.safetensors", dest / "model.safetensors")
    return dest


def served_al(ckpt: Path, verifier_dir: Path, target: Path, k: int, work: Path, prompts) -> float | None:
    from dspark_kit.engines.lifecycle import ManagedServer
    from dspark_kit.engines.llamacpp import LlamaCppServe, plan_llamacpp
    from dspark_kit.engines.ports import free_port
    from dspark_kit.measure.llamacpp_accept import served
    from dspark_kit.specdec.gguf_export import export_gguf

    out = export_gguf(ckpt, work / "gguf", verifier_dir, target)
    plan = plan_llamacpp(LlamaCppServe(role="spec", verifier_gguf=out["verifier"], draft_gguf=out["draft"], k=k,
                                       host="127.0.0.1", port=free_port(), served_name="smol", seed=0))
    with ManagedServer(plan, work / "server.log") as srv:
        srv.wait_healthy(300)
        got = served(srv.base_url, prompts)
    assert got["acceptance"] is not None, "llama.cpp reported no speculative steps"
    # the server's counters and the responses' timings agree on what was accepted
    assert got["acceptance"]["num_accepted_tokens"] == got["timings_draft_n_accepted"]
    return got["acceptance"]["acceptance_length"]


def test_regen_on_llama_server_keeps_its_own_token_ids(trained):
    """llama-server ignores vLLM's return_token_ids; regen asks it for logprobs, whose entries carry
    each generated token's id: every reply keeps the ids the server generated (they decode to its
    text, and a reply that stopped ends on <|im_end|>, as vLLM's do), and prepare trains them."""
    from transformers import AutoTokenizer

    from dspark_kit.jsonl import read_jsonl

    wd, _ckpt, verifier_dir, _own = trained
    tok = AutoTokenizer.from_pretrained(verifier_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = list(read_jsonl(wd / "regen.jsonl"))
    assert len(rows) == len(QUESTIONS)
    finishes = []
    for row in rows:
        reply, finish = row["conversations"][-1], row["metadata"]["finish_reasons"][-1]
        ids = reply.get("token_ids")
        assert ids, f"row {row['metadata']['idx']}: no token ids kept from llama-server"
        assert tok.decode(ids, skip_special_tokens=True) == reply["value"]
        assert (ids[-1] == end) == (finish == "stop"), (finish, ids[-3:])
        finishes.append(finish)
    assert "stop" in finishes, finishes  # the end-of-turn case was seen, not only cut replies
    log = (wd / "logs" / "stage-prepare.log").read_text()
    assert f"{len(QUESTIONS)} replies trained on the verifier's own token ids" in log, log[-2000:]


def test_served_acceptance_matches_in_process_and_planted_faults_fail_the_gate(trained, f16_target, tmp_path):
    from dspark_kit.measure.llamacpp_accept import PromptSet, chat_prompt_ids, gate_line, in_process
    from dspark_kit.specdec.gguf_export import read_draft_gguf

    _wd, ckpt, verifier_dir, _own = trained
    cfg = json.loads((ckpt / "config.json").read_text())
    k = cfg["block_size"] - (0 if cfg["sample_from_anchor"] else 1)
    k = min(k, cfg["block_size"] - 1)  # a K both anchor layouts can draft, for the flipped variant
    prompts = PromptSet(chat_prompt_ids(verifier_dir, QUESTIONS), MAX_NEW)
    ref = in_process(verifier_dir, ckpt, prompts, k)["acceptance"]["acceptance_length"]
    assert ref > 1.05, f"the trained draft accepts almost nothing in-process (AL {ref}); nothing to compare"

    good = served_al(ckpt, verifier_dir, f16_target, k, tmp_path / "good", prompts)
    assert gate_line(good, ref, MIN_FRACTION, "trained draft") is None, (good, ref)
    d = read_draft_gguf(tmp_path / "good" / "gguf" / "draft.gguf")
    assert d["sample_from_anchor"] == cfg["sample_from_anchor"] and d["block_size"] == cfg["block_size"]

    flipped = served_al(variant(ckpt, tmp_path / "flip" / "ckpt", flip_anchor=True), verifier_dir, f16_target, k,
                        tmp_path / "flip", prompts)
    line = gate_line(flipped, ref, MIN_FRACTION, "sample_from_anchor flipped")
    assert line is not None and "\n" not in line, (flipped, ref, good)
    # The zeroed Markov head: llama.cpp must read it (greedy serving is deterministic, so the same prompts
    # accept differently without it). Measured on this fixture's draft: 0.476 accepted per step against
    # 0.507 with the head: the head adds too little here for the gate to catch its loss (not asserted).
    zeroed = served_al(variant(ckpt, tmp_path / "zero" / "ckpt", zero_markov=True), verifier_dir, f16_target, k,
                       tmp_path / "zero", prompts)
    assert zeroed != good and zeroed < good, (zeroed, good, ref)


def test_a_llama_draft_arch_converts_to_the_same_draft_gguf(trained, tmp_path):
    """speculators' DSpark layers are Qwen3's for either draft.arch (the arch picks only the config
    class carrying the verifier's sizes: the same seed trains the same weights): the checkpoint with
    the layer config speculators writes for draft.arch llama converts, through llama.cpp's own
    converter, to the same draft GGUF byte for byte, so the export refuses neither."""
    from speculators.train.cli import create_transformer_layer_config

    from dspark_kit.specdec.gguf_export import export_gguf

    _wd, ckpt, verifier_dir, own = trained
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    n = cfg["transformer_layer_config"]["num_hidden_layers"]
    # what speculators' DSpark config serializes (field_serializer: to_diff_dict)
    layer = create_transformer_layer_config(str(verifier_dir), n, "llama", None, 2048, list(range(n))).to_diff_dict()
    assert layer["model_type"] == "llama" and layer != cfg["transformer_layer_config"]
    relabelled = tmp_path / "llama"
    relabelled.mkdir()
    (relabelled / "config.json").write_text(json.dumps({**cfg, "transformer_layer_config": layer}))
    (relabelled / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    drafts = [Path(export_gguf(c, tmp_path / f"gguf-{c.name}", verifier_dir, own)["draft"]) for c in (ckpt, relabelled)]
    assert drafts[0].read_bytes() == drafts[1].read_bytes()
