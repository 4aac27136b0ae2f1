"""prepare writes speculators' prepared dataset itself (streaming); it must be what
speculators' own pre-tokenized path makes of the same rows: same columns and types, same
format, the same rows in the same order, the same token frequencies."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_kit.data.conversations import normalize
from dspark_kit.data.template_rows import tokenize_conversation
from dspark_kit.data.tiny_corpus import conversations
from dspark_kit.stages.dataset.prepare import prepare

pytestmark = pytest.mark.slow  # prepares with the tiny verifier's tokenizer


def test_prepared_dataset_is_speculators_own(tmp_path, tiny_verifier):
    from datasets import load_from_disk
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset
    from transformers import AutoTokenizer

    rows = [{"messages": m} for m in conversations(40, seed=5, max_turns=3)]
    ours = tmp_path / "ours"
    prepare(rows, str(tiny_verifier), ours, seq_length=64, thinking=False, seed=3,
            cut_replies="train")  # as speculators does: a row cut at seq_length trains what is left

    # the same rows through speculators: tokenized the same way, handed to its pre-tokenized path
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    src = tmp_path / "tokenized.jsonl"
    with src.open("w") as f:
        for row in rows:
            for ids, mask in tokenize_conversation(tok, normalize(row), False)[0]:
                if any(mask[:64]):
                    f.write(json.dumps({"input_ids": ids[:64], "loss_mask": mask[:64]}) + "\n")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    data, _ = load_and_preprocess_dataset(
        target_model_path=str(tiny_verifier), train_data_paths=[str(src)], seq_length=64, build_dataset_num_proc=1,
        seed=3, token_freq_path=theirs / "token_freq.pt", skip_token_freq=False)
    data.save_to_disk(str(theirs))

    a, b = load_from_disk(str(ours)), load_from_disk(str(theirs))
    assert a.features == b.features and a.format == b.format and len(a) == len(b) > 40
    for x, y in zip(a, b, strict=True):
        assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "loss_mask", "seq_len"))
    assert torch.load(ours / "token_freq.pt") == torch.load(theirs / "token_freq.pt")
