"""Stage 2, hidden states (offline, local backend): verifier forward -> hs_{i}.safetensors.

Layer ids follow vLLM: id k is the residual stream entering decoder layer k
(`output_hidden_states[k]` in HF), and id N (= num_hidden_layers) is the
output of the last layer *before* the final norm -- HF's last tuple entry is
after the norm, so id N comes from a forward hook on the last layer. Each
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


class VerifierTap:
    """A verifier forward that returns the exported layers (vLLM layer-id convention)."""

    def __init__(self, model, layer_ids: list[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.n = model.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i <= self.n]
        if bad:
            raise ValueError(f"layer ids {bad} outside 0..{self.n} (num_hidden_layers={self.n})")
        self._last = None
        layers = model.model.layers
        layers[-1].register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output):
        self._last = output[0] if isinstance(output, tuple) else output

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[seq] ids -> [seq, len(layer_ids), hidden]."""
        out = self.model.model(input_ids=input_ids[None], output_hidden_states=True, use_cache=False)
        hs = out.hidden_states  # N+1 entries; entry N is post-norm, so use the hook for id N
        picked = [self._last[0] if i == self.n else hs[i][0] for i in self.layer_ids]
        return torch.stack(picked, dim=1)


def load_verifier(path: str, device: str, dtype: str = "float32", trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    return model.to(device).eval()


def is_valid_file(path: Path, token_ids: list[int]) -> bool:
    """A file that opens, has both keys, the right length and finite values."""
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states

    try:
        check_hidden_states(load_file(str(path)), token_ids)
        return True
    except Exception:
        return False


class _Writer(threading.Thread):
    """Writes tensors off the compute thread; the first error stops the run."""

    def __init__(self):
        super().__init__(daemon=True)
        self.q: queue.Queue = queue.Queue(maxsize=8)
        self.error: BaseException | None = None

    def run(self):
        from safetensors.torch import save_file

        while (item := self.q.get()) is not None:
            path, tensors = item
            if self.error:
                continue
            tmp = path.with_name(path.name + ".tmp")
            try:
                save_file(tensors, str(tmp))
                tmp.replace(path)
            except BaseException as e:  # disk full etc.: surface it on the main thread
                tmp.unlink(missing_ok=True)
                self.error = e

    def put(self, path: Path, tensors: dict) -> None:
        if self.error:
            raise OSError(f"writing hidden states failed: {self.error}") from self.error
        self.q.put((path, tensors))

    def close(self) -> None:
        self.q.put(None)
        self.join()
        if self.error:
            raise OSError(f"writing hidden states failed: {self.error}") from self.error


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
    out = Path(prepared_dir) / "hidden_states"
    out.mkdir(parents=True, exist_ok=True)
    data = load_from_disk(str(prepared_dir))
    lengths = [int(x) for x in data["seq_len"]]
    model = load_verifier(verifier_path, device, dtype, trust_remote_code)
    hidden = model.config.hidden_size
    estimate = sum(lengths) * len(layer_ids) * hidden * torch.finfo(getattr(torch, out_dtype)).bits // 8
    free = shutil.disk_usage(out).free
    log(f"hidden states: {len(lengths)} rows, {sum(lengths):,} tokens, layers {layer_ids} "
        f"-> ~{estimate / 2**20:,.1f} MiB in {out} ({free / 2**30:,.1f} GiB free)")
    if estimate > free:
        raise OSError(f"hidden states need ~{estimate / 2**30:.1f} GiB but {out} has {free / 2**30:.1f} GiB free; "
                      "free space or use hidden_states.mode: online")
    tap = VerifierTap(model, layer_ids)
    writer = _Writer()
    writer.start()
    generated = skipped = corrupt = 0
    try:
        with progress_bar("hidden-states", total=len(lengths), unit="row") as bar:
            for i in range(len(lengths)):
                path = out / f"hs_{i}.safetensors"
                ids = torch.as_tensor(data[i]["input_ids"], dtype=torch.long)
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
