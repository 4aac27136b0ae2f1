import pytest
import torch
from safetensors.torch import load_file

from dspark_kit.data.tiny_corpus import conversations
from dspark_kit.stages.hidden_states import generate_offline
from dspark_kit.stages.prepare import prepare

pytestmark = pytest.mark.slow  # runs the tiny verifier


def _prepared(tmp_path, tiny_verifier, n=6):
    rows = [{"messages": m} for m in conversations(n, seed=3)]
    out = tmp_path / "prepared"
    prepare(rows, str(tiny_verifier), out, seq_length=128, thinking=False)
    return out


def test_offline_files_resume_and_corruption(tmp_path, tiny_verifier):
    prepared = _prepared(tmp_path, tiny_verifier)
    s = generate_offline(prepared, str(tiny_verifier), [1, 2, 4], log=lambda *_: None)
    assert s.generated == s.rows and s.skipped == 0
    f0 = load_file(str(prepared / "hidden_states" / "hs_0.safetensors"))
    assert f0["hidden_states"].dtype == torch.bfloat16 and f0["token_ids"].dtype == torch.int64
    assert f0["hidden_states"].shape == (len(f0["token_ids"]), 3, 128)
    # truncate one file: it is found and regenerated, the others are skipped
    victim = prepared / "hidden_states" / "hs_1.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])
    s2 = generate_offline(prepared, str(tiny_verifier), [1, 2, 4], log=lambda *_: None)
    assert (s2.generated, s2.regenerated_corrupt, s2.skipped) == (1, 1, s.rows - 1)
    assert load_file(str(victim))["hidden_states"].shape[1] == 3
    assert not list((prepared / "hidden_states").glob("*.tmp"))


def test_speculators_dataset_reads_what_we_wrote(tmp_path, tiny_verifier):
    from datasets import load_from_disk
    from speculators.train.data import ArrowDataset

    prepared = _prepared(tmp_path, tiny_verifier)
    generate_offline(prepared, str(tiny_verifier), [1, 2, 4], log=lambda *_: None)
    ds = ArrowDataset(max_len=128, datapath=str(prepared), on_missing="raise")
    rows = load_from_disk(str(prepared))
    for i in range(len(ds)):
        item = ds[i]
        assert torch.equal(item["input_ids"], torch.as_tensor(rows[i]["input_ids"]))
        assert item["hidden_states"].shape[-1] == 2 * 128  # targets flattened, last layer separate
        assert item["verifier_last_hidden_states"].shape[-1] == 128
