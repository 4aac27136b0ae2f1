"""speculators' prepared dataset, written as the rows stream in.

The format its trainer and data-generation tools read: an Arrow dataset saved with
`save_to_disk` (columns `input_ids`, `loss_mask` int64 lists and `seq_len` int64, torch
format) and `token_freq.pt` ({token id: count over loss-masked tokens}). speculators'
own pre-tokenized path (`load_and_preprocess_dataset`) reads the rows back from JSON
into the user's HF cache, maps them with `keep_in_memory=True` (the whole dataset in
RAM) and counts token frequencies one torch-formatted row at a time (most of prepare's
time on short rows). We write the same thing without holding it: rows go to an Arrow
file in the work dir as they come, the order is speculators' (two shuffles with the
seed: one of the raw rows, one of the result), the counts are taken on the way.
tests/test_speculators_dataset.py holds the result to speculators' own on the same rows.
"""

from __future__ import annotations

from collections import Counter
from itertools import compress
from pathlib import Path


def _features():
    from datasets import Features, List, Value

    return Features({"input_ids": List(Value("int64")), "loss_mask": List(Value("int64")),
                     "seq_len": Value("int64")})


class DatasetWriter:
    """add() rows of (input_ids, loss_mask) as they come; save() the dataset and token_freq.pt."""

    def __init__(self, work: Path):
        from datasets.arrow_writer import ArrowWriter

        self.path = Path(work) / "rows.arrow"
        self._writer = ArrowWriter(features=_features(), path=str(self.path))
        self.token_freq: Counter = Counter()
        self.rows = 0

    def add(self, rows: list[tuple[list[int], list[int]]]) -> None:
        if not rows:
            return
        self._writer.write_batch({"input_ids": [ids for ids, _ in rows], "loss_mask": [m for _, m in rows],
                                  "seq_len": [len(ids) for ids, _ in rows]})
        for ids, mask in rows:
            self.token_freq.update(compress(ids, mask))
        self.rows += len(rows)

    def save(self, out: Path, seed: int) -> None:
        """The dataset into `out` (which must not exist yet), in speculators' row order."""
        import datasets
        import torch

        self._writer.finalize()
        self._writer.close()
        data = datasets.Dataset.from_file(str(self.path)).shuffle(seed=seed).shuffle(seed=seed)
        data.set_format(type="torch")
        was_off = datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # prepare's own line says it is saving; no tqdm bar on stderr
        try:
            data.save_to_disk(str(out))
        finally:
            if not was_off:
                datasets.enable_progress_bars()
        torch.save(dict(sorted(self.token_freq.items())), Path(out) / "token_freq.pt")

    @staticmethod
    def repeats(out: Path, train_ratio: float) -> tuple[int, int, int]:
        """(rows that repeat an earlier row token for token, rows of the validation split, of those the
        ones that repeat a training row) of a saved dataset. speculators validates on its last rows
        (split at int(n * train_ratio), speculators 0.9.0 ArrowDataset): a copy of a training row there
        measures what the draft has seen. Read back from the saved file, as the trainer reads it."""
        import hashlib

        import datasets
        import pyarrow as pa

        data = datasets.load_from_disk(str(out)).with_format("arrow")
        n = len(data)
        split = int(n * train_ratio)
        seen_train, seen, repeated, val_seen, i = set(), set(), 0, 0, 0
        for batch in data.iter(batch_size=4096):
            col = batch["input_ids"].combine_chunks() if isinstance(batch["input_ids"], pa.ChunkedArray) else batch["input_ids"]
            offsets, values = col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=False)
            for k in range(len(col)):
                h = hashlib.blake2b(values[offsets[k]:offsets[k + 1]].tobytes(), digest_size=16).digest()
                repeated += h in seen
                seen.add(h)
                if i < split:
                    seen_train.add(h)
                else:
                    val_seen += h in seen_train
                i += 1
        return repeated, n - split, val_seen

    def close(self) -> None:
        """Release the file when the run stops before save() (safe to call twice)."""
        self._writer.close()
