"""Hidden-state files an earlier run computed, linked into this run for rows identical token for token.

A fine-tune on grown data (the earlier run's rows plus new ones) would otherwise compute every row's
hidden states again, the costliest stage on a large verifier. `hidden_states.reuse_from: DIR` names
the earlier run: before the stage computes anything, each row of this run's DIR/prepared without a
file gets a hard link (a copy across file systems) to the earlier run's file of a row with the same
token ids. The stage then checks every linked file as its own (token ids, dtype, finite values) and
computes only the rest; it writes a temp file renamed over a link it rejects, so the earlier run's
files are never written through a link.

The earlier run must have computed them as this run would: its manifest's verifier path, target
layers and hidden-state dtypes (compute and file) must equal this run's, else one line names the key.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark_kit.rundir import RunDir, hidden_state_file, hidden_states_dir
from dspark_kit.stages.manifest import load_manifest


class ReuseError(ValueError):
    """One line naming hidden_states.reuse_from or the key that differs, and the fix."""


@dataclass(frozen=True)
class HiddenStateMaker:
    """What decides a hidden-state file's values besides its token ids."""

    verifier: str  # verifier.path
    target_layer_ids: tuple[int, ...] | None  # hidden_states.target_layer_ids (None: the default for the verifier)
    compute_dtype: str  # the verifier's dtype in the forward (resolved)
    file_dtype: str  # the files' dtype (hidden_states.dtype, resolved)


KEYS = {"verifier": "verifier.path", "target_layer_ids": "hidden_states.target_layer_ids",
        "compute_dtype": "the verifier's compute dtype", "file_dtype": "hidden_states.dtype"}


def maker_of(manifest: dict, where: Path) -> HiddenStateMaker:
    """The maker an earlier run's manifest records (its recipe and the resolver's decisions)."""
    try:
        recipe, resolved = manifest["recipe"], manifest["resolved"]
        ids = recipe["hidden_states"]["target_layer_ids"]
        return HiddenStateMaker(recipe["verifier"]["path"], None if ids is None else tuple(ids),
                                resolved["hidden_states_dtype"]["value"], resolved["hidden_states_out_dtype"]["value"])
    except (KeyError, TypeError):
        raise ReuseError(f"hidden_states.reuse_from {where}: its manifest.json records no verifier, target layers "
                         "and hidden-state dtypes; name a run folder of the kit's whose hidden-states stage ran") from None


def _row_keys(prepared: Path):
    """(row, a digest of its token ids) for each row of a prepared dataset, read a batch at a time
    (a large dataset's ids are never held at once)."""
    from datasets import load_from_disk

    data = load_from_disk(str(prepared)).with_format(None).select_columns(["input_ids"])
    row = 0
    for batch in data.iter(batch_size=1024):
        for ids in batch["input_ids"]:
            yield row, hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=16).digest()
            row += 1


def _link(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copyfile(src, tmp)  # another file system (or one without hard links): a copy
    tmp.replace(dst)


def link_reused(prepared: Path, earlier: Path, maker: HiddenStateMaker,
                log: Callable[[str], None] = lambda _line: None) -> dict:
    """Link the earlier run's files into DIR/prepared/hidden_states for rows this run has no file for;
    returns what it did (rows, linked, where from)."""
    earlier = Path(earlier)
    run = RunDir.at(earlier)
    if not hidden_states_dir(run.prepared).is_dir():
        raise ReuseError(f"hidden_states.reuse_from {earlier}: no hidden-state files in {hidden_states_dir(run.prepared)}"
                         " (name a run folder whose offline hidden-states stage ran)")
    theirs = maker_of(load_manifest(earlier), earlier)
    for field, value in asdict(maker).items():
        if asdict(theirs)[field] != value:
            raise ReuseError(f"hidden_states.reuse_from {earlier}: its files were made with {KEYS[field]} "
                             f"{asdict(theirs)[field]}, this run's is {value}; their values would differ from this "
                             "run's own (drop reuse_from, or run with the same value)")
    src_dir, out = hidden_states_dir(run.prepared), hidden_states_dir(prepared)
    have = {}
    for j, key in _row_keys(run.prepared):
        if (f := hidden_state_file(src_dir, j)).exists():
            have.setdefault(key, f)
    out.mkdir(parents=True, exist_ok=True)
    rows = linked = 0
    for i, key in _row_keys(prepared):
        rows += 1
        if not (dst := hidden_state_file(out, i)).exists() and (src := have.get(key)) is not None:
            _link(src, dst)
            linked += 1
    log(f"hidden states: {linked} of {rows} rows linked from {src_dir} (identical token ids; checked as this "
        "run's own files next)")
    return {"reused_from": str(src_dir), "rows_linked": linked}
