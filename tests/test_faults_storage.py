"""Storage faults: disk full during hidden-state writes, corrupt files, prepare interrupted."""

from __future__ import annotations

import errno
import json
import shutil

import pytest

pytestmark = pytest.mark.slow  # prepares and writes hidden states with the tiny verifier

LAYERS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_verifier):
    """A small prepared dataset (12 rows); tests copy it before touching it."""
    from dspark_kit.data.tiny_corpus import conversations
    from dspark_kit.stages.dataset.prepare import prepare

    d = tmp_path_factory.mktemp("faults") / "prepared"
    rows = [{"messages": m} for m in conversations(12, seed=3, max_turns=1)]
    prepare(rows, str(tiny_verifier), d, seq_length=128, thinking=False)
    return d


@pytest.fixture()
def work(prepared, tmp_path):
    dst = tmp_path / "prepared"
    shutil.copytree(prepared, dst)
    return dst


def _generate(work, tiny_verifier):
    from dspark_kit.stages.hidden.hidden_states import generate_offline

    return generate_offline(work, str(tiny_verifier), LAYERS, log=lambda _m: None)


def _row_ids(work) -> list[list[int]]:
    from datasets import load_from_disk

    return [list(x) for x in load_from_disk(str(work))["input_ids"]]


def _all_named_files_valid(work) -> int:
    from dspark_kit.specdec.hidden_state_files import is_valid_file

    ids = _row_ids(work)
    files = sorted((work / "hidden_states").glob("hs_*.safetensors"))
    for f in files:
        i = int(f.stem.split("_")[1])
        assert is_valid_file(f, ids[i]), f"{f.name} has a valid name but is not a valid file"
    return len(files)


def test_disk_full_fails_clearly_leaves_no_corrupt_file_and_a_rerun_completes(work, tiny_verifier, monkeypatch):
    import safetensors.torch as st

    real_save, written = st.save_file, []

    def save_until_full(tensors, filename, *a, **kw):
        if len(written) >= 5:
            with open(filename, "wb") as f:  # a partial write, as a full disk leaves it
                f.write(b"\x00" * 17)
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(filename)
        return real_save(tensors, filename, *a, **kw)

    monkeypatch.setattr(st, "save_file", save_until_full)
    with pytest.raises(OSError, match="writing hidden states failed.*No space left"):
        _generate(work, tiny_verifier)
    monkeypatch.setattr(st, "save_file", real_save)

    out = work / "hidden_states"
    assert not list(out.glob("*.tmp")), "a temp file was left behind"
    assert _all_named_files_valid(work) == 5

    s = _generate(work, tiny_verifier)  # space is back: resume
    assert s.skipped == 5 and s.generated == s.rows - 5 and s.regenerated_corrupt == 0
    assert _all_named_files_valid(work) == s.rows


def test_truncated_and_garbage_files_are_regenerated(work, tiny_verifier):
    first = _generate(work, tiny_verifier)
    out = work / "hidden_states"
    truncated, garbage, empty = out / "hs_0.safetensors", out / "hs_3.safetensors", out / "hs_7.safetensors"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    garbage.write_bytes(b"not a safetensors file at all")
    empty.write_bytes(b"")
    s = _generate(work, tiny_verifier)
    assert s.regenerated_corrupt == 3 and s.generated == 3 and s.skipped == first.rows - 3
    assert _all_named_files_valid(work) == first.rows


def test_a_file_for_another_row_is_not_taken_as_valid(work, tiny_verifier):
    # a stale file (e.g. from a previous prepare) has the right name but other tokens
    first = _generate(work, tiny_verifier)
    out = work / "hidden_states"
    ids = _row_ids(work)
    other = next(j for j in range(1, first.rows) if ids[j] != ids[0])
    shutil.copy(out / f"hs_{other}.safetensors", out / "hs_0.safetensors")
    s = _generate(work, tiny_verifier)
    assert s.regenerated_corrupt == 1
    assert _all_named_files_valid(work) == first.rows


@pytest.mark.parametrize("where", ["tokenizing", "building the dataset"])
@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt])
def test_interrupted_prepare_leaves_no_complete_looking_output(tmp_path, tiny_verifier, monkeypatch, where, kind):
    from dspark_kit.data.speculators_dataset import DatasetWriter
    from dspark_kit.data.tiny_corpus import conversations
    from dspark_kit.stages.dataset import prepare as P

    rows = [{"messages": m} for m in conversations(200, seed=4, max_turns=1)]  # 4 chunks of 64
    out = tmp_path / "prepared"
    if where == "tokenizing":
        real_work, calls = P._work, []

        def work_then_die(args):
            calls.append(1)
            if len(calls) == 3:
                raise kind("interrupted")
            return real_work(args)

        monkeypatch.setattr(P, "_work", work_then_die)
    else:
        def die(*_a, **_kw):
            raise kind("interrupted")

        monkeypatch.setattr(DatasetWriter, "save", die)
    with pytest.raises(kind, match="interrupted"):
        P.prepare(rows, str(tiny_verifier), out, seq_length=128, thinking=False)
    assert not out.exists()
    # nor an errors file: it is published with the dataset, or with a verdict that failed the run
    assert [p.name for p in tmp_path.iterdir()] == [], "temp work dirs left behind"


def test_interrupted_prepare_keeps_the_previous_complete_output(prepared, tmp_path, tiny_verifier, monkeypatch):
    from dspark_kit.data.speculators_dataset import DatasetWriter
    from dspark_kit.stages.dataset import prepare as P

    out = tmp_path / "prepared"
    shutil.copytree(prepared, out)
    before = sorted(p.name for p in out.iterdir())

    def die(*_a, **_kw):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(DatasetWriter, "save", die)
    with pytest.raises(RuntimeError):
        P.prepare([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
                  str(tiny_verifier), out, seq_length=128, thinking=False)
    assert sorted(p.name for p in out.iterdir()) == before
    assert len(_row_ids(out)) == len(_row_ids(prepared))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]


def test_a_prepare_that_fails_its_verdict_leaves_the_errors_file_that_says_why(tmp_path, tiny_verifier):
    from dspark_kit.stages.dataset import prepare as P

    rows = [{"messages": [{"role": "user", "content": "q"}]}, {"nonsense": 1}]  # nothing to train
    with pytest.raises(ValueError, match="no trainable rows"):
        P.prepare(rows, str(tiny_verifier), tmp_path / "prepared", seq_length=128, thinking=False)
    entries = [json.loads(x) for x in (tmp_path / "prepared.errors.jsonl").read_text().splitlines()]
    assert [e["action"] for e in entries] == ["dropped", "dropped"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared.errors.jsonl"]
