"""Hidden-state files an earlier run computed, linked into this run for rows identical token for token.

A fine-tune on grown data (the earlier run's rows plus new ones) would otherwise compute every row's
hidden states again, the costliest stage on a large verifier. `hidden_states.reuse_from: DIR` names
the earlier run: before the stage computes anything, each row of this run's DIR/prepared without a
file gets a hard link (a copy across file systems) to the earlier run's file of a row with the same
token ids, once the file holds those ids in this run's dtype (a file that does not is left to
compute). The stage then checks every file as its own and computes only the rest; it writes a temp
file renamed over a link it rejects, so the earlier run's files are never written through a link.

The earlier run must have computed them as this run would: the verifier path, the exported layers
and the hidden-state dtypes (compute and file) its hidden-states stage recorded (`made_with` in its
summary; a run from before that record: the layers it recorded, the rest from its manifest) must
equal this run's, else one line names the key.
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
from dspark_kit.specdec.hidden_state_files import is_valid_file
from dspark_kit.stages.manifest import load_manifest


class ReuseError(ValueError):
    """One line naming hidden_states.reuse_from or the key that differs, and the fix."""


@dataclass(frozen=True)
class HiddenStateMaker:
    """What decides a hidden-state file's values besides its token ids."""

    verifier: str  # verifier.path
    layer_ids: tuple[int, ...]  # the layers the files hold (hidden_states.target_layer_ids and the last)
    compute_dtype: str  # the verifier's dtype in the forward (resolved)
    file_dtype: str  # the files' dtype (hidden_states.dtype, resolved)

    def record(self) -> dict:
        """What the stage's summary keeps (`made_with`), read back by maker_of."""
        return {**asdict(self), "layer_ids": list(self.layer_ids)}


KEYS = {"verifier": "verifier.path", "layer_ids": "layers (hidden_states.target_layer_ids and the last)",
        "compute_dtype": "the verifier's compute dtype", "file_dtype": "hidden_states.dtype"}


def maker_of(manifest: dict, where: Path) -> HiddenStateMaker:
    """How an earlier run's files were made: its hidden-states stage's own record; for a run from
    before it kept one, the layers the stage recorded and the rest from the manifest's last command."""
    stage = (((manifest.get("stages") or {}).get("hidden-states") or {}).get("summary")) or {}
    try:
        if "made_with" in stage:
            made = stage["made_with"]
            return HiddenStateMaker(made["verifier"], tuple(made["layer_ids"]), made["compute_dtype"],
                                    made["file_dtype"])
        recipe, resolved = manifest["recipe"], manifest["resolved"]
        return HiddenStateMaker(recipe["verifier"]["path"], tuple(stage["layer_ids"]),
                                resolved["hidden_states_dtype"]["value"], resolved["hidden_states_out_dtype"]["value"])
    except (KeyError, TypeError):
        raise ReuseError(f"hidden_states.reuse_from {where}: its manifest.json records no hidden-states stage that "
                         "says how its files were made; name a run folder whose offline hidden-states stage "
                         "ran") from None


def _row_keys(prepared: Path):
    """(row, a digest of its token ids, the ids) for each row of a prepared dataset, read a batch at
    a time (a large dataset's ids are never held at once)."""
    from datasets import load_from_disk

    data = load_from_disk(str(prepared)).with_format(None).select_columns(["input_ids"])
    row = 0
    for batch in data.iter(batch_size=1024):
        for ids in batch["input_ids"]:
            yield row, hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=16).digest(), ids
            row += 1


# link() refused: another file system, or one without hard links (some FUSE and SMB mounts)
NO_HARD_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP}


def _link(src: Path, dst: Path) -> None:
    """dst as a hard link to src (else a copy), in place at once. The temp name is this process's:
    with backend vllm every node runs the stage over the same shared folder, and two nodes linking
    one row put the same file there."""
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError as e:
        if e.errno not in NO_HARD_LINK:
            raise
        shutil.copyfile(src, tmp)
    tmp.replace(dst)


def link_reused(prepared: Path, earlier: Path, maker: HiddenStateMaker,
                log: Callable[[str], None] = lambda _line: None) -> dict:
    """Link the earlier run's files into DIR/prepared/hidden_states for rows this run has no file for;
    returns what it did (rows, linked, where from)."""
    earlier = Path(earlier)
    run = RunDir.at(earlier)
    src_dir, out = hidden_states_dir(run.prepared), hidden_states_dir(prepared)
    if not src_dir.is_dir():
        raise ReuseError(f"hidden_states.reuse_from {earlier}: no hidden-state files in {src_dir}"
                         " (name a run folder whose offline hidden-states stage ran)")
    theirs = maker_of(load_manifest(earlier), earlier)
    made, mine = theirs.record(), maker.record()
    for field, value in mine.items():
        if made[field] != value:
            raise ReuseError(f"hidden_states.reuse_from {earlier}: its files were made with {KEYS[field]} "
                             f"{made[field]}, this run's is {value}; their values would differ from this "
                             "run's own (drop reuse_from, or run with the same value)")
    have = {}
    for j, key, _ids in _row_keys(run.prepared):
        if (f := hidden_state_file(src_dir, j)).exists():
            have.setdefault(key, f)
    out.mkdir(parents=True, exist_ok=True)
    rows = linked = unfit = 0
    for i, key, ids in _row_keys(prepared):
        rows += 1
        if (dst := hidden_state_file(out, i)).exists() or (src := have.get(key)) is None:
            continue
        if not is_valid_file(src, list(ids), maker.file_dtype):  # e.g. its prepare reran after: left to compute
            unfit += 1
            continue
        _link(src, dst)
        linked += 1
    log(f"hidden states: {linked} of {rows} rows linked from {src_dir} (identical token ids)"
        + (f"; {unfit} of its files for them did not hold those ids in {maker.file_dtype}: computed" if unfit else ""))
    return {"reused_from": str(src_dir), "rows_linked": linked, "rows_not_linked_unfit": unfit}
