"""fp8 hidden states end to end on the tiny verifier: the kit's fp8 files read back by speculators'
own ArrowDataset through hs-connectors' FP8Transfer (what `speculators train --hidden-states-backend
fp8` builds), and a tiny training run on them. The format itself: tests/test_hidden_state_files.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import TINY_RECIPE
from safetensors.torch import load_file

from dspark_kit.data.tiny_corpus import conversations
from dspark_kit.stages.dataset.prepare import prepare
from dspark_kit.stages.hidden.hidden_states import generate_offline

pytestmark = pytest.mark.slow  # runs the tiny verifier, trains

LAYERS = [1, 2, 4]
# float8_e4m3fn keeps 3 mantissa bits: rounding moves a value by at most 1/16 of itself, so at
# most 1/16 of its token's largest value (the scale is per token); bf16's dequantized product adds
# a 2^-8 rounding at most
FP8_TOLERANCE = 1 / 16 + 2**-8


def test_speculators_arrow_dataset_reads_kit_fp8_files_within_fp8_precision(tmp_path, tiny_verifier):
    from datasets import load_from_disk
    from hs_connectors import FP8Transfer
    from speculators.train.data import ArrowDataset

    rows = [{"messages": m} for m in conversations(6, seed=3)]
    prepared = tmp_path / "prepared"
    prepare(rows, str(tiny_verifier), prepared, seq_length=128, thinking=False)
    exact = generate_offline(prepared, str(tiny_verifier), LAYERS, out_dtype="float32", log=lambda *_: None)
    reference = {i: load_file(str(prepared / "hidden_states" / f"hs_{i}.safetensors")) for i in range(exact.rows)}
    # the same run folder in fp8: the float32 files are rewritten, none kept in the other dtype
    s = generate_offline(prepared, str(tiny_verifier), LAYERS, out_dtype="fp8", log=lambda *_: None)
    assert (s.generated, s.regenerated_corrupt, s.skipped) == (s.rows, s.rows, 0)
    again = generate_offline(prepared, str(tiny_verifier), LAYERS, out_dtype="fp8", log=lambda *_: None)
    assert (again.generated, again.skipped) == (0, s.rows)  # valid fp8 files are kept on a resume
    raw = load_file(str(prepared / "hidden_states" / "hs_0.safetensors"))
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn and "hidden_states_scales" in raw

    ds = ArrowDataset(max_len=128, datapath=str(prepared), transfer=FP8Transfer(prepared / "hidden_states"),
                      on_missing="raise")
    data = load_from_disk(str(prepared))
    worst = 0.0
    for i in range(len(ds)):
        item, ref = ds[i], reference[i]["hidden_states"]
        assert torch.equal(item["input_ids"], torch.as_tensor(data[i]["input_ids"]))
        assert item["hidden_states"].dtype == torch.bfloat16  # dequantized: the trainer never sees fp8
        # the dataset's split: targets flattened, the last layer apart
        got = torch.cat([item["hidden_states"].reshape(ref.shape[0], len(LAYERS) - 1, -1),
                         item["verifier_last_hidden_states"].unsqueeze(1)], dim=1).float()
        per_token_max = ref.abs().amax(dim=(1, 2), keepdim=True)
        worst = max(worst, ((got - ref).abs() / per_token_max).max().item())
    print(f"\n[fp8] speculators' ArrowDataset read {len(ds)} kit fp8 files; worst error {worst:.4f} of a token's "
          f"largest value (tolerance {FP8_TOLERANCE:.4f})")
    assert 0 < worst <= FP8_TOLERANCE


def test_tiny_training_reads_fp8_files(tmp_path, tiny_verifier):
    """`dspark-kit run` prepare -> hidden-states -> train with hidden_states.dtype fp8: fp8 files on
    disk, the trainer reads them through --hidden-states-backend fp8 and the draft learns."""
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "--workdir", str(tmp_path),
           "--stages", "prepare,hidden-states,train", "--json", "--set", "hidden_states.dtype=fp8",
           "--set", "data.limit=32", "--set", "train.epochs=4", "--set", "regen.enabled=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    al = {s["stage"]: s for s in json.loads(proc.stdout)["stages"]}["train"]["figure"]
    files = sorted((tmp_path / "prepared" / "hidden_states").glob("hs_*.safetensors"))
    assert files and all(load_file(str(f))["hidden_states"].dtype == torch.float8_e4m3fn for f in files)
    argv = json.loads((tmp_path / "manifest.json").read_text())["stages"]["train"]["argv"]
    assert argv[argv.index("--hidden-states-backend") + 1] == "fp8"
    print(f"\n[fp8] tiny training on fp8 files: val accept_len {al:.3f}")
    assert al > 1.1  # the draft learned from them (untrained: 1.0)
