import json

import pytest

from dspark_kit.data.conversations import ConversationError, normalize
from dspark_kit.data.template_rows import tokenize_conversation
from dspark_kit.jsonl import read_jsonl
from dspark_kit.stages.dataset.prepare import PrepareSummary, prepare


@pytest.fixture(scope="module")
def tok(tiny_verifier):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_verifier)


def trained_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.slow
def test_single_turn_mask_is_the_assistant_reply(tok, thinking):
    msgs = [{"role": "user", "content": "Count from 1 to 3."}, {"role": "assistant", "content": "1, 2, 3."}]
    rows, fanned = tokenize_conversation(tok, msgs, thinking)
    assert not fanned and len(rows) == 1
    ids, mask = rows[0]
    text = trained_text(tok, ids, mask)
    assert text.startswith("<think>\n\n</think>\n\n1, 2, 3.") if thinking else text.startswith("1, 2, 3.")
    assert "Count from" not in text and "<|im_start|>" not in text


@pytest.mark.slow
def test_history_that_renders_differently_fans_out_one_row_per_turn(tok):
    # The last turn gets a think block, earlier ones do not (Qwen3 rule): the
    # incremental render is not a prefix of the full one, so one row per turn.
    msgs = [
        {"role": "user", "content": "Repeat after me: one."}, {"role": "assistant", "content": "one."},
        {"role": "user", "content": "Repeat after me: two."}, {"role": "assistant", "content": "two."},
    ]
    rows, fanned = tokenize_conversation(tok, msgs, thinking=False)
    assert fanned and len(rows) == 2
    assert trained_text(tok, *rows[0]).startswith("one.")
    second = trained_text(tok, *rows[1])
    assert second.startswith("two.") and "one." not in second
    assert "one." in tok.decode(rows[1][0])  # history is still there as context


@pytest.mark.slow
def test_trailing_user_turn_is_dropped_and_no_assistant_is_rejected(tok):
    with pytest.raises(ConversationError, match="no assistant turn"):
        tokenize_conversation(tok, [{"role": "user", "content": "hi"}], False)
    rows, _ = tokenize_conversation(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                          {"role": "user", "content": "c"}], False)
    assert "c<|im_end|>" not in tok.decode(rows[0][0])


@pytest.mark.parametrize("row, reason", [
    ({}, "no 'conversations'"),
    ({"conversations": []}, "empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "no user turn"),
    ("not an object", "row must be an object"),
])
def test_normalize_rejects_with_a_reason(row, reason):
    with pytest.raises(ConversationError, match=reason):
        normalize(row)


def test_formats_agree():
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    openai = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    pair = {"prompt": "q", "response": "a"}
    assert normalize(sharegpt) == normalize(openai) == normalize(pair)


@pytest.mark.slow
def test_prepare_writes_speculators_format_and_counts_rejects(tmp_path, tiny_verifier):
    import torch
    from datasets import load_from_disk

    src = tmp_path / "in.jsonl"
    good = {"conversations": [{"from": "human", "value": "Count from 1 to 5."}, {"from": "gpt", "value": "1, 2, 3, 4, 5."}]}
    long = {"messages": [{"role": "user", "content": "Count from 1 to 90."},
                         {"role": "assistant", "content": ", ".join(map(str, range(1, 91)))}]}
    prompt_too_long = {"messages": [{"role": "user", "content": "Repeat after me: " + "the cat " * 80},
                                    {"role": "assistant", "content": "the cat"}]}
    lines = [json.dumps(good)] * 6 + [json.dumps(long), json.dumps(prompt_too_long),
                                      json.dumps({"messages": []}), "{not json"]
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "prepared"
    # the cut reply trained as cut, as asked (by default it carries no loss: test_data_in.py)
    s = prepare(read_jsonl(src), str(tiny_verifier), out, seq_length=64, thinking=False, num_workers=2,
                cut_replies="train")
    assert s.conversations_in == 10 == s.conversations_used + sum(s.rejected.values())
    assert s.rows_out == 7 and sum(s.rejected.values()) == 3
    assert s.cut_replies == 1 and sum(s.changed.values()) == 1
    assert s.truncated == 1 and s.no_trainable_tokens == 1  # the reply fell past seq_length
    assert s.rejected["no assistant token within data.seq_length (prompt too long)"] == 1
    ds = load_from_disk(str(out))
    assert set(ds.column_names) >= {"input_ids", "loss_mask", "seq_len"}
    assert all(n <= 64 for n in ds["seq_len"])
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    trained = sum(int(sum(m)) for m in ds["loss_mask"])
    assert sum(freq.values()) == trained  # counts cover loss_mask == 1 only
    meta = json.loads((out / "prepare_meta.json").read_text())
    assert meta["thinking"] is False and meta["seq_length"] == 64


@pytest.mark.slow
def test_prepare_with_nothing_trainable_is_a_clear_error(tmp_path, tiny_verifier):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="no trainable rows.*no assistant turn"):
        prepare(read_jsonl(src), str(tiny_verifier), tmp_path / "p", seq_length=64, thinking=False)
    assert not (tmp_path / "p").exists()  # nothing half-written that looks complete


def test_saving_the_prepared_dataset_prints_no_progress_bar(tmp_path, capfd):
    """prepare's own line says what it wrote; datasets' 'Saving the dataset' tqdm bar on stderr did not
    belong there (and the setting is restored for whoever else uses datasets)."""
    import datasets

    from dspark_kit.data.speculators_dataset import DatasetWriter

    (tmp_path / "work").mkdir()
    w = DatasetWriter(tmp_path / "work")
    w.add([([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1])])
    w.save(tmp_path / "out", seed=0)
    err = capfd.readouterr().err
    assert "Saving the dataset" not in err and "%|" not in err, err
    assert not datasets.are_progress_bars_disabled()
    assert datasets.load_from_disk(str(tmp_path / "out")).num_rows == 2


def test_prepare_cli_prints_one_line_and_names_itself_once(tmp_path):
    """stdout: the stage's one-line result (it was a raw dict dump); an error names the stage once
    (it read `prepare: prepare: ...`). The verifier is the tokenizer fixture: prepare reads no weights."""
    from pathlib import Path

    from typer.testing import CliRunner

    from dspark_kit.cli import app

    fixture = Path(__file__).resolve().parent / "fixtures" / "tiny_tokenizer"
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                                      {"role": "assistant", "content": f"a {i}"}]}) + "\n"
                             for i in range(3)))
    base = ["prepare", "--set", f"verifier.path={fixture}", "--set", "regen.enabled=false", "--set",
            "data.seq_length=64", "-w", str(tmp_path / "run")]
    r = CliRunner().invoke(app, [*base, "--set", f"data.source={chats}"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().splitlines()[-1] == "prepare: training rows 3", r.stdout
    assert "{" not in r.stdout
    r = CliRunner().invoke(app, [*base, "--set", f"data.source={tmp_path / 'missing.jsonl'}"])
    assert r.exit_code == 1 and r.output.count("prepare:") == 1 and "data.source" in r.output, r.output


def test_rows_repeated_and_validation_rows_seen_in_training_are_counted_as_speculators_splits(tmp_path):
    """Greedy regen answers a repeated prompt with the same reply: the row is trained twice, and a copy
    in speculators' validation split (its last rows) inflates the trainer's validation acceptance.
    The expected counts come from speculators' own split of the saved dataset."""
    from speculators.train.data import ArrowDataset

    from dspark_kit.data.speculators_dataset import DatasetWriter

    (tmp_path / "work").mkdir()
    w = DatasetWriter(tmp_path / "work")
    rows = [([1, 2, i], [0, 1, 1]) for i in range(30)] + [([1, 2, i], [0, 1, 1]) for i in range(10)]
    w.add(rows)
    out = tmp_path / "out"
    w.save(out, seed=0)
    repeated, val_rows, val_seen = DatasetWriter.repeats(out, 0.75)

    def split(name):
        return [tuple(r.tolist()) for r in ArrowDataset(datapath=str(out), max_len=8, train_ratio=0.75,
                                                         split=name).data["input_ids"]]
    train, val = split("train"), split("val")
    assert repeated == 10 and val_rows == len(val) == 10
    assert val_seen == sum(v in set(train) for v in val) and 0 < val_seen < 10
    s = PrepareSummary(repeated_rows=repeated, val_rows=val_rows, val_rows_seen=val_seen)
    assert f"{val_seen} of the 10 validation rows" in s.repeats_line() and "runs high" in s.repeats_line()
