"""Stage 2, hidden states (offline, local backend): verifier forward -> hs_{i}.safetensors.

Layer ids follow vLLM's convention (read by dspark_kit.specdec.verifier.LayerTap). Each
file holds `hidden_states` [seq, len(ids), hidden] in hidden_states.dtype and `token_ids`
int64 [seq] (fp8: hs-connectors' fp8 files, with a scale per token:
specdec/hidden_state_files.py); `i` is the row index in the prepared dataset, exactly what
speculators' file dataloader reads.

Rows of one length share a forward (no padding, so each file holds its own
row's states), rows are read per group, never all at once. Resumable: valid
files are skipped, unreadable ones regenerated. On an accelerator writes run on
a background thread (tmp file, then rename) so the forward never waits on disk.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.resolved import Resolved
from dspark_kit.resolved.storage_plan import human, offline_bytes, written_bytes
from dspark_kit.rundir import hidden_state_file, hidden_states_dir
from dspark_kit.specdec import hidden_state_files
from dspark_kit.stages.plan import StagePlan


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


def length_groups(lengths, max_tokens: int) -> list[list[int]]:
    """Row indices in groups of one length (so no padding: each row's states are exactly those
    of its own forward), at most `max_tokens` tokens or one row per group."""
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(int(n), []).append(i)
    groups = []
    for n, rows in sorted(by_length.items()):
        per = max(1, max_tokens // max(n, 1))
        groups += [rows[k : k + per] for k in range(0, len(rows), per)]
    return groups


def generate_offline(
    prepared_dir: Path,
    verifier_path: str,
    layer_ids: list[int],
    *,
    device: str = "cpu",
    dtype: str = "float32",
    out_dtype: str = "bfloat16",
    trust_remote_code: bool = False,
    max_batch_tokens: int = 4096,
    reporter: Reporter = STANDALONE,
    log=None,
) -> HiddenStatesSummary:
    """One forward per group of equal-length rows (`length_groups`): a short row's forward is
    mostly per-call overhead, and same-length rows batch without padding or masks. Rows are read
    per group, never the whole dataset; files are named by row index, so the order is free."""
    import torch  # here, not at import: the stage's plan needs no torch
    from datasets import load_from_disk

    from dspark_kit.specdec.verifier import LayerTap, load_verifier

    log = log or reporter.note
    t0 = time.time()
    out = hidden_states_dir(prepared_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = load_from_disk(str(prepared_dir))
    lengths = [int(x) for x in data["seq_len"]]  # one column; the rows are read per group
    tokens = sum(lengths)
    model = load_verifier(verifier_path, device, dtype, trust_remote_code)
    hidden = model.config.hidden_size
    estimate = offline_bytes(tokens, len(lengths), len(layer_ids), hidden, out_dtype)
    needed, free = max(0, estimate - written_bytes(out)), shutil.disk_usage(out).free  # a resume writes the rest
    log(f"hidden states: {len(lengths)} rows, {tokens:,} tokens, layers {layer_ids} "
        f"-> ~{human(estimate)} in {out} ({human(needed)} still to write, {human(free)} free)")
    if needed > free:
        raise OSError(f"hidden states need ~{human(needed)} more but {out} has {human(free)} free; "
                      "free space or use hidden_states.mode: online")
    tap = LayerTap(model, layer_ids)
    writer = _Writer(background=not str(device).startswith("cpu"))
    writer.start()
    generated = skipped = corrupt = 0
    try:
        with reporter.bar("hidden-states", total=len(lengths), unit="row") as bar:
            for group in length_groups(lengths, max_batch_tokens):
                ids = torch.as_tensor(data[group]["input_ids"], dtype=torch.long)
                todo = []
                for b, i in enumerate(group):
                    path = hidden_state_file(out, i)
                    if path.exists():
                        if hidden_state_files.is_valid_file(path, ids[b].tolist(), out_dtype):
                            skipped += 1
                            continue
                        corrupt += 1
                    todo.append((b, path))
                if todo:
                    rows = ids[[b for b, _ in todo]]
                    # fp8 quantizes each row from the verifier's own values (its scales are per token)
                    stacked = None if out_dtype == hidden_state_files.FP8 else getattr(torch, out_dtype)
                    hs = tap.batch(rows.to(device), stacked)
                    for k, (_b, path) in enumerate(todo):
                        tensors = hidden_state_files.file_tensors(hs[k], rows[k], out_dtype)
                        writer.put(path, {name: t.cpu() for name, t in tensors.items()})
                    generated += len(todo)
                bar.advance(len(group))
    finally:
        writer.close()
    return HiddenStatesSummary(len(lengths), generated, skipped, corrupt, list(layer_ids), estimate, time.time() - t0)


# ---- the stage ---------------------------------------------------------------


def plan(res: Resolved) -> StagePlan:
    """The bytes offline files take (or would), what each node needs for hidden states, and the
    processes backend vllm starts."""
    from dspark_kit.resolved.storage_plan import plan_lines
    from dspark_kit.stages.hidden.hidden_states_vllm import node_notes, offline_processes

    hs, lines, processes = res.recipe.hidden_states, plan_lines(res), []
    outputs = {"hidden_states": str(res.run.hidden_states)} if hs.mode == "offline" else {}
    inputs = {"prepared": str(res.run.prepared), "verifier": res.verifier_path}
    if hs.reuse_from:
        inputs["reuse_from"] = hs.reuse_from
        lines.append(f"# first links {hs.reuse_from}'s hidden-state files for rows with the same token ids "
                     "(hidden_states.reuse_from), then computes the rest")
    if hs.backend == "local" and hs.mode == "offline":
        lines += [*node_notes(res), (f"# nothing to launch: hidden_states backend=local runs in-process on "
                                     f"{res.train_device.value} in {res.hidden_states_dtype.value} (once; every "
                                     "node reads DIR/prepared/hidden_states)")]
    elif hs.mode == "online" and hs.backend == "local":
        lines.append("# online, backend local: `dspark-kit train` starts the kit's own extraction server on each node")
    else:
        more, processes = offline_processes(res)
        lines += more
    return StagePlan.of(res, "hidden-states", lines, processes, inputs, outputs)


def run(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    recipe = res.recipe
    if recipe.hidden_states.mode == "online":
        return {"skipped": "hidden_states.mode is online: the trainer asks a server"}
    from dspark_kit.stages.hidden.reuse import HiddenStateMaker, link_reused

    maker = HiddenStateMaker(recipe.verifier.path, tuple(res.exported_layer_ids), res.hidden_states_dtype.value,
                             res.hidden_states_out_dtype.value)
    reused = {"made_with": maker.record()}  # what a later run's reuse_from checks against its own
    if recipe.hidden_states.reuse_from:
        reused |= link_reused(res.run.prepared, Path(recipe.hidden_states.reuse_from), maker, reporter.note)
    if recipe.hidden_states.backend != "local":
        from dspark_kit.stages.hidden.hidden_states_vllm import run_offline_vllm

        return {**run_offline_vllm(res, plan, reporter), **reused}
    s = generate_offline(
        res.run.prepared, res.verifier_path, res.exported_layer_ids, device=res.train_device.value,
        dtype=res.hidden_states_dtype.value, out_dtype=res.hidden_states_out_dtype.value,
        trust_remote_code=recipe.verifier.trust_remote_code, reporter=reporter,
    )
    return {**s.as_dict(), **reused}
