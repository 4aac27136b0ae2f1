"""What offline hidden states take on disk, next to the free space where they go.

bytes = tokens x exported layers (the target layers + the last one) x hidden size x the file
dtype's bytes, plus each token's id (int64), fp8's float32 scale per token, and each file's
header: `offline_bytes`, the one formula (generate_offline checks the disk with it too), from
the file format's own sizes (specdec/hidden_state_files.py). The tokens come from the prepared rows
once prepare has run (prepare_meta.json: what it wrote), else from a sample of the rows prepare
would read, tokenized as prepare does and scaled to the row count, else the bound rows x
data.seq_length. Files go to DIR/prepared/hidden_states; backend vllm stages each one in
hidden_states.storage_path first, which only needs room for the files in flight.

Dry runs (`hidden-states --dry-run`, `run --dry-run`) print the plan, preflight prints it and
makes it an error when offline files will not fit.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark_kit.recipe import DTYPE_BYTES
from dspark_kit.resolved import Resolved
from dspark_kit.resolved.memory_plan import human
from dspark_kit.rundir import hidden_state_row
from dspark_kit.specdec.hidden_state_files import FP8, header_bytes, token_bytes

SAMPLE = 200  # conversations tokenized for an estimate before prepare


def offline_bytes(tokens: int, rows: int, layers: int, hidden: int, dtype: str) -> int:
    """Bytes of hs_{i}.safetensors files for `rows` rows holding `tokens` tokens in all."""
    return tokens * token_bytes(layers, hidden, dtype) + rows * header_bytes(dtype)


def free_bytes(path: Path) -> int | None:
    """Free space of the filesystem `path` is (or will be) on: its nearest existing parent's."""
    for p in (Path(path).absolute(), *Path(path).absolute().parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def written_bytes(dest: Path) -> int:
    """Bytes of hidden-state files already in `dest` (a resumed run needs room for the rest only)."""
    try:
        with os.scandir(dest) as it:
            return sum(e.stat().st_size for e in it if hidden_state_row(e.name) is not None)
    except OSError:
        return 0


@dataclass
class StoragePlan:
    mode: str
    bytes: int | None  # all offline files; None when the hidden size or the tokens are unknown here
    tokens: int | None
    rows: int | None
    basis: str  # where the token count came from
    layers: int | None
    hidden: int | None
    dtype: str | None  # None: this machine cannot write the recipe's (basis says why)
    dest: str
    free: int | None
    written: int  # already in dest

    @property
    def needed(self) -> int | None:
        return None if self.bytes is None else max(0, self.bytes - self.written)

    @property
    def fits(self) -> bool | None:
        return None if self.needed is None or self.free is None else self.needed <= self.free

    def as_dict(self) -> dict:
        return {**asdict(self), "needed": self.needed, "fits": self.fits}

    def line(self) -> str:
        where = f"{self.dest} ({human(self.free)} free)" if self.free is not None else self.dest
        if self.bytes is None:
            unknown = ("the file dtype" if self.dtype is None else
                       "the verifier's hidden size (set verifier.hidden_size to plan)" if self.hidden is None
                       else "the token count")
            size = f"unknown here: {unknown}; {self.basis}"
        else:
            extra = "ids, a float32 scale per token" if self.dtype == FP8 else "ids"
            size = (f"~{human(self.bytes)} = {self.tokens:,} tokens x {self.layers} layers x hidden {self.hidden} x "
                    f"{self.dtype} ({DTYPE_BYTES[self.dtype]} B) + {extra} and headers; tokens from {self.basis}")
        if self.mode == "online":  # nothing is written: whether offline would fit is no question here
            return (f"storage: hidden_states.mode online writes no hidden states ahead (each trainer asks the "
                    f"extraction server for a batch's states as it trains); offline would take {size}")
        head = f"storage: offline hidden states {size} -> {where}"
        if self.written:
            head += f"; {human(self.written)} already there"
        return head if self.fits is not False else head + f"; does NOT fit: {human(self.needed)} still to write"


def plan_storage(res: Resolved) -> StoragePlan:
    from dspark_kit.recipe import RecipeError

    hs = res.recipe.hidden_states
    try:
        layers = len(res.exported_layer_ids)
    except RecipeError:
        layers = None
    try:
        hidden = res.hidden_size
    except RecipeError:
        hidden = None
    tokens, rows, basis = _tokens(res)
    try:
        dtype = res.hidden_states_out_dtype.value
    except RecipeError as e:  # fp8 this machine cannot write: nothing to size (preflight names it an error)
        dtype, basis = None, str(e)
    total = (offline_bytes(tokens, rows, layers, hidden, dtype)
             if None not in (tokens, rows, layers, hidden, dtype) else None)
    dest = res.run.hidden_states
    return StoragePlan(hs.mode, total, tokens, rows, basis, layers, hidden, dtype, str(dest), free_bytes(dest),
                       written_bytes(dest))


def _tokens(res: Resolved) -> tuple[int | None, int | None, str]:
    """(tokens, rows, where they came from)."""
    meta = res.run.prepared / "prepare_meta.json"
    try:
        summary = json.loads(meta.read_text())["summary"]
        return int(summary["tokens"]), int(summary["rows_out"]), f"the prepared rows ({meta.name})"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    conversations, source, rows = _input(res)
    sampled = _sample(res, rows) if rows is not None else None
    if sampled and conversations:
        n, tokens, out_rows = sampled
        scale = conversations / n
        return (round(tokens * scale), round(out_rows * scale),
                f"{n} of {conversations:,} conversations of {source} tokenized as prepare does")
    if conversations:
        seq = res.recipe.data.seq_length
        return (conversations * seq, conversations,
                (f"at most {conversations:,} conversations x data.seq_length {seq} (one full row each; "
                 f"{source} not tokenized here)"))
    return None, None, f"{source}: its size is unknown here (set data.limit)"


def _input(res: Resolved):
    """(conversations prepare will read or None, what they are, their rows or None when they
    cannot be read here). The rows are prepare's own (resolved/prepare_input.py); before regen
    has run, the data source's replies stand in for the ones regen will write."""
    from dspark_kit.data.sources import iter_rows, names_hub_dataset, source_size
    from dspark_kit.resolved.prepare_input import prepare_input_rows

    recipe, data = res.recipe, res.recipe.data
    before_regen = recipe.regen.enabled and not res.run.regen_jsonl.exists()
    hub = names_hub_dataset(data)
    if before_regen or hub:
        n = source_size(data) or data.limit
        what = f"data.source {data.source}" + (" (replies before regen)" if before_regen else "")
        if hub:  # a hub dataset: not fetched for a plan
            return n, what, None
        try:
            return n, what, (row for _, row in iter_rows(data))  # as read: prepare keeps a row's `tools`
        except (OSError, ValueError):
            return n, what, None
    try:
        rows, total, _, source = prepare_input_rows(res)
    except (OSError, ValueError):
        return source_size(data) or data.limit, f"data.source {data.source}", None
    return total or data.limit, source if recipe.regen.enabled else f"data.source {source}", rows


def _sample(res: Resolved, rows) -> tuple[int, int, int] | None:
    """(conversations read, tokens and rows prepare would write for them) for up to SAMPLE
    conversations, with the verifier's tokenizer when this machine has it."""
    from dspark_kit.data.conversations import normalize, row_tools
    from dspark_kit.data.template_rows import row_thinking, tokenize_conversation
    from dspark_kit.jsonl import BadLine

    if not Path(res.verifier_path).is_dir():
        return None
    try:
        from dspark_kit.specdec.verifier_facts import plan_tokenizer

        tok = plan_tokenizer(res.verifier_path, res.recipe.verifier.trust_remote_code)
        recipe = res.recipe
        seq, thinking, keep = recipe.data.seq_length, recipe.verifier.thinking, recipe.data.keep_truncated
        n = tokens = out_rows = 0
        for raw in itertools.islice(rows, SAMPLE):
            n += 1
            if isinstance(raw, BadLine):
                continue
            try:
                mode = row_thinking(raw, thinking, recipe.mixture_seed)
                for ids, mask in tokenize_conversation(tok, normalize(raw), mode, keep, row_tools(raw))[0]:
                    if any(mask[:seq]):
                        tokens, out_rows = tokens + min(len(ids), seq), out_rows + 1
            except Exception:  # noqa: BLE001, S112 - a row prepare rejects (unusable, or the template fails on it)
                continue
    except (OSError, ValueError):
        return None
    return (n, tokens, out_rows) if n else None


def plan_lines(res: Resolved) -> list[str]:
    """The plan as a dry run's comment line (one line whatever happens)."""
    try:
        return [f"# {plan_storage(res).line()}"]
    except (OSError, ValueError) as e:  # what this machine cannot read: the dry run goes on
        return [f"# storage: not planned ({type(e).__name__}: {e})"]
