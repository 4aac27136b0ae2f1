"""atomic.write_text: a reader never sees half a file, and two writers of one file never trip on
each other (the trainer nodes of a multi-node job record their stage into one shared run folder)."""

from __future__ import annotations

import threading

from dspark_kit.atomic import write_text

WRITES = 400


def test_two_writers_of_one_file_never_fail_and_leave_no_temp_files(tmp_path):
    """Two threads stand for two processes: a temp name shared by writers fails here at once, one
    renaming the other's file away (FileNotFoundError)."""
    target = tmp_path / "state.json"
    errors: list[BaseException] = []

    def write_many(tag: str) -> None:
        try:
            for i in range(WRITES):
                write_text(target, f"{tag} {i}\n" * 50)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    writers = [threading.Thread(target=write_many, args=(tag,)) for tag in "ab"]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
    assert not errors, errors[0]
    lines = set(target.read_text().splitlines())
    assert len(lines) == 1 and lines.pop() in {f"{t} {WRITES - 1}" for t in "ab"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
