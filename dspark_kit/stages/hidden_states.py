"""Stage 2, hidden states (offline, local backend): verifier forward -> hs_{i}.safetensors.

Layer ids follow vLLM's convention (read by dspark_kit.specdec.verifier.LayerTap). Each
file holds `hidden_states` [seq, len(ids), hidden] (bf16) and `token_ids`
int64 [seq]; `i` is the row index in the prepared dataset, exactly what
speculators' file dataloader reads.

Resumable: valid files are skipped, unreadable ones regenerated. Writes run
on a background thread (tmp file, then rename) so the forward never waits on
disk.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_kit.progress import note
from dspark_kit.rundir import hidden_states_dir
from dspark_kit.specdec.verifier import LayerTap, load_verifier


@dataclass
class HiddenStatesSummary:
    rows: int
    generated: int
    skipped: int
    regenerated_corrupt: int
    layer_ids: list[int]
    bytes_estimate: int
    seconds: float

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["tokens_per_s"] = None
        return d


def is_valid_file(path: Path, token_ids: list[int]) -> bool:
    """A file that opens, has both keys, the right length and finite values."""
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states

    try:
        check_hidden_states(load_file(str(path)), token_ids)
        return True
    except Exception:  # noqa: BLE001 - any unreadable file is simply regenerated
        return False


class _Writer(threading.Thread):
    """Writes tensors off the compute thread; the first error stops the run.

    On an accelerator the writes overlap the next forward. On CPU there is
    nothing to overlap with -- the forward already uses every core, and a
    writer thread only contends with torch's threads (measured slower) -- so
    `background=False` writes inline with the same error handling.
    """

    def __init__(self, background: bool = True):
        super().__init__(daemon=True)
        self.background = background
        self.q: queue.Queue = queue.Queue(maxsize=8)
        self.error: BaseException | None = None

    def start(self) -> None:
        if self.background:
            super().start()

    def _write(self, path: Path, tensors: dict) -> None:
        from safetensors.torch import save_file

        tmp = path.with_name(path.name + ".tmp")
        try:
            save_file(tensors, str(tmp))
            tmp.replace(path)
        except BaseException as e:  # noqa: BLE001 - disk full etc.: surface it on the main thread
            tmp.unlink(missing_ok=True)
            self.error = e

    def run(self):
        while (item := self.q.get()) is not None:
            if not self.error:
                self._write(*item)

    def _raise(self) -> None:
        if self.error:
            raise OSError(f"writing hidden states failed: {self.error}") from self.error

    def put(self, path: Path, tensors: dict) -> None:
        self._raise()
        if self.background:
            self.q.put((path, tensors))
        else:
            self._write(path, tensors)
            self._raise()

    def close(self) -> None:
        if self.background:
            self.q.put(None)
            self.join()
        self._raise()


def generate_offline(
    prepared_dir: Path,
    verifier_path: str,
    layer_ids: list[int],
    *,
    device: str = "cpu",
    dtype: str = "float32",
    out_dtype: str = "bfloat16",
    trust_remote_code: bool = False,
    log=note,
) -> HiddenStatesSummary:
    from datasets import load_from_disk

    from dspark_kit.progress import progress_bar

    t0 = time.time()
    out = hidden_states_dir(prepared_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = load_from_disk(str(prepared_dir))
    lengths = [int(x) for x in data["seq_len"]]
    all_ids = list(data["input_ids"])  # one column read; indexing the lazy Column costs ~0.5 ms a row
    model = load_verifier(verifier_path, device, dtype, trust_remote_code)
    hidden = model.config.hidden_size
    estimate = sum(lengths) * len(layer_ids) * hidden * torch.finfo(getattr(torch, out_dtype)).bits // 8
    free = shutil.disk_usage(out).free
    log(f"hidden states: {len(lengths)} rows, {sum(lengths):,} tokens, layers {layer_ids} "
        f"-> ~{estimate / 2**20:,.1f} MiB in {out} ({free / 2**30:,.1f} GiB free)")
    if estimate > free:
        raise OSError(f"hidden states need ~{estimate / 2**30:.1f} GiB but {out} has {free / 2**30:.1f} GiB free; "
                      "free space or use hidden_states.mode: online")
    tap = LayerTap(model, layer_ids)
    writer = _Writer(background=not str(device).startswith("cpu"))
    writer.start()
    generated = skipped = corrupt = 0
    try:
        with progress_bar("hidden-states", total=len(lengths), unit="row") as bar:
            for i in range(len(lengths)):
                path = out / f"hs_{i}.safetensors"
                ids = torch.as_tensor(all_ids[i], dtype=torch.long)
                if path.exists():
                    if is_valid_file(path, ids.tolist()):
                        skipped += 1
                        bar.advance()
                        continue
                    corrupt += 1
                hs = tap(ids.to(device)).to(getattr(torch, out_dtype)).cpu().contiguous()
                writer.put(path, {"hidden_states": hs, "token_ids": ids.cpu().contiguous()})
                generated += 1
                bar.advance()
    finally:
        writer.close()
    return HiddenStatesSummary(len(lengths), generated, skipped, corrupt, list(layer_ids), estimate, time.time() - t0)
