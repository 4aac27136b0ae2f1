import pytest
import torch
from safetensors.torch import load_file

from dspark_kit.data.tiny_corpus import conversations
from dspark_kit.stages.dataset.prepare import prepare
from dspark_kit.stages.hidden.hidden_states import generate_offline

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


def test_length_groups_cover_every_row_once_with_one_length_each():
    from dspark_kit.stages.hidden.hidden_states import length_groups

    lengths = [5, 3, 5, 5, 9, 3, 5, 2000]
    groups = length_groups(lengths, max_tokens=12)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len({lengths[i] for i in g}) == 1 for g in groups)
    assert all(sum(lengths[i] for i in g) <= 12 or len(g) == 1 for g in groups)
    assert [0, 2] in groups and [3, 6] in groups  # two rows of 5 fit in 12 tokens, in row order


def test_batched_files_hold_each_rows_own_forward(tmp_path, tiny_verifier, monkeypatch):
    """Rows of one length share a forward; each file must still be its own row's states."""
    from datasets import load_from_disk

    from dspark_kit.specdec.verifier import LayerTap, load_verifier

    prepared = _prepared(tmp_path, tiny_verifier, n=24)
    lengths = [int(x) for x in load_from_disk(str(prepared))["seq_len"]]
    assert len(set(lengths)) < len(lengths), "the check needs rows that share a length"
    forwards = []
    real_batch = LayerTap.batch
    monkeypatch.setattr(LayerTap, "batch", lambda self, ids, dtype=None: forwards.append(len(ids))
                        or real_batch(self, ids, dtype))
    s = generate_offline(prepared, str(tiny_verifier), [1, 2, 4], log=lambda *_: None)
    assert s.generated == len(lengths) and len(forwards) == len(set(lengths)) and max(forwards) > 1

    tap = LayerTap(load_verifier(str(tiny_verifier), "cpu"), [1, 2, 4])
    rows = load_from_disk(str(prepared))["input_ids"]
    for i, ids in enumerate(rows):
        f = load_file(str(prepared / "hidden_states" / f"hs_{i}.safetensors"))
        own = tap(torch.as_tensor(ids)).to(torch.bfloat16)
        assert torch.equal(f["token_ids"], torch.as_tensor(ids))
        # one bf16 step at most (a batched matmul may round differently); another row's states are far off
        torch.testing.assert_close(f["hidden_states"].float(), own.float(), rtol=2**-7, atol=1e-5)
