"""Stage 1, prepare: chat rows -> speculators' Arrow dataset + token_freq.pt.

We render with the verifier's own tokenizer and chat template (no vLLM
/render server needed), then hand the `input_ids` + `loss_mask` rows to
speculators' pre-tokenized path, so the saved dataset and `token_freq.pt` are
exactly what `speculators prepare-data` would write.

Loss mask rule: the tokens after the generation-prompt render of the prefix
are trainable, for every assistant turn. When the template renders history
differently from the incremental render (Qwen3 drops earlier turns' reasoning
and gives only the last turn a think block), one row per assistant turn is
emitted instead: history as the template renders it at that turn, loss on that
turn only -- the rule speculators applies with a vLLM renderer.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dspark_kit.data.chat import render
from dspark_kit.data.conversations import ConversationError, normalize
from dspark_kit.progress import progress_bar

_TOKENIZER = None


@dataclass
class PrepareSummary:
    conversations_in: int = 0
    rows_out: int = 0
    per_turn_rows: int = 0  # rows from conversations whose history re-renders differently
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    no_trainable_tokens: int = 0
    truncated: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["rejected"] = dict(self.rejected)
        d["tokens_per_s"] = round(self.tokens / self.seconds, 1) if self.seconds else None
        return d


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def conversation_texts(tok, msgs: list[dict], thinking: bool) -> list[str]:
    """The renders the loss mask needs: per assistant turn j, the prompt (msgs[:j] + generation
    prompt) then the text up to and including turn j. The last one is the full conversation."""
    turns = [j for j, m in enumerate(msgs) if m["role"] == "assistant" and j > 0]
    if not turns:
        raise ConversationError("no assistant turn after a user turn")
    msgs = msgs[: turns[-1] + 1]  # trailing user turns have nothing to learn
    texts = []
    for j in turns:
        texts.append(render(tok, msgs[:j], thinking, add_generation_prompt=True))
        texts.append(render(tok, msgs[: j + 1], thinking))
    return texts


def rows_from_ids(ids: list[list[int]]) -> tuple[list[tuple[list[int], list[int]]], bool]:
    """(input_ids, loss_mask) rows from the token ids of `conversation_texts`, and whether it fanned out.

    One row when every prompt/turn render is a token prefix of the full render; else one row per
    turn (history as the template renders it at that turn, loss on that turn only)."""
    prompts, uptos = ids[0::2], ids[1::2]
    full = uptos[-1]
    mask = [0] * len(full)
    for prompt, upto in zip(prompts, uptos):
        if full[: len(prompt)] != prompt or full[: len(upto)] != upto:
            break
        mask[len(prompt) : len(upto)] = [1] * (len(upto) - len(prompt))
    else:
        return [(full, mask)], False
    rows = []
    for prompt, upto in zip(prompts, uptos):
        boundary = len(prompt) if upto[: len(prompt)] == prompt else _common_prefix(prompt, upto)
        rows.append((upto, [0] * boundary + [1] * (len(upto) - boundary)))
    return rows, True


def _encode_batch(tok, texts: list[str]) -> list[list[int]]:
    """chat.encode over many texts in one call (no special tokens added: the template holds them)."""
    if not texts:
        return []
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: same ids, none of the per-row wrapping
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]


def tokenize_conversation(tok, msgs: list[dict], thinking: bool) -> tuple[list[tuple[list[int], list[int]]], bool]:
    """Rows of (input_ids, loss_mask) for one conversation, and whether it fanned out per turn."""
    return rows_from_ids(_encode_batch(tok, conversation_texts(tok, msgs, thinking)))


def _init_worker(tokenizer_path: str, trust_remote_code: bool) -> None:
    global _TOKENIZER
    from transformers import AutoTokenizer

    _TOKENIZER = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)


def _row_result(rows, fanned: bool, seq_length: int) -> dict:
    kept = [{"input_ids": ids[:seq_length], "loss_mask": mask[:seq_length], "truncated": len(ids) > seq_length}
            for ids, mask in rows]
    return {"rows": kept, "fanned": fanned}


def _work(args: tuple[list, bool, int]) -> list[dict]:
    """Tokenize a chunk of raw rows; one result dict per input row.

    Renders every text of the chunk first, then encodes them in one batched tokenizer call
    (the Rust tokenizer's batch path is much cheaper than one call per prefix)."""
    raw_rows, thinking, seq_length = args
    out: list[dict] = []
    planned: list[tuple[int, list[str]]] = []  # (index in out, texts)
    for raw in raw_rows:
        try:
            planned.append((len(out), conversation_texts(_TOKENIZER, normalize(raw), thinking)))
            out.append({})
        except ConversationError as e:
            out.append({"error": str(e)})
        except Exception as e:  # noqa: BLE001 - a template that cannot render this row is a rejected row
            out.append({"error": f"template failed: {type(e).__name__}: {e}"})
    try:
        ids = _encode_batch(_TOKENIZER, [t for _, texts in planned for t in texts])
    except Exception:  # noqa: BLE001 - one bad text must not sink the chunk: encode row by row
        ids = None
    pos = 0
    for i, texts in planned:
        try:
            row_ids = ids[pos : pos + len(texts)] if ids is not None else _encode_batch(_TOKENIZER, texts)
            out[i] = _row_result(*rows_from_ids(row_ids), seq_length)
        except Exception as e:  # noqa: BLE001 - a row the tokenizer cannot take is a rejected row
            out[i] = {"error": f"tokenizer failed: {type(e).__name__}: {e}"}
        pos += len(texts)
    return out


def _chunks(rows: Iterable, size: int) -> Iterator[list]:
    buf: list = []
    for r in rows:
        buf.append(r)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def read_jsonl(path: Path) -> Iterator[dict | str]:
    """Rows of a jsonl file; an unparsable line is yielded as its text (and rejected later)."""
    with path.open() as f:
        for line in f:
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    yield line


def prepare(
    rows: Iterable,
    tokenizer_path: str,
    out_dir: Path,
    *,
    seq_length: int,
    thinking: bool,
    num_workers: int = 1,
    seed: int = 0,
    trust_remote_code: bool = False,
    total: int | None = None,
    meta: dict | None = None,
) -> PrepareSummary:
    """Tokenize `rows` and write the speculators dataset atomically to `out_dir`."""
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset

    summary = PrepareSummary()
    t0 = time.time()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir.parent))
    try:
        tokenized = work / "tokenized.jsonl"
        chunks = ((c, thinking, seq_length) for c in _chunks(rows, 64))
        with tokenized.open("w") as f, progress_bar("prepare", total=total, unit="conv") as bar:
            if num_workers > 1:
                pool = ProcessPoolExecutor(num_workers, initializer=_init_worker, initargs=(tokenizer_path, trust_remote_code))
                results = pool.map(_work, chunks)
            else:
                _init_worker(tokenizer_path, trust_remote_code)
                pool, results = None, map(_work, chunks)
            for chunk in results:
                for res in chunk:
                    summary.conversations_in += 1
                    if "error" in res:
                        summary.rejected[res["error"].split(":")[0]] += 1
                        continue
                    for r in res["rows"]:
                        if not any(r["loss_mask"]):
                            summary.no_trainable_tokens += 1
                            continue
                        summary.rows_out += 1
                        summary.per_turn_rows += res["fanned"]
                        summary.truncated += r["truncated"]
                        summary.tokens += len(r["input_ids"])
                        summary.trainable_tokens += sum(r["loss_mask"])
                        f.write(json.dumps({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}) + "\n")
                bar.advance(len(chunk))
            if pool:
                pool.shutdown()
        if summary.rows_out == 0:
            raise ValueError(
                f"prepare: no trainable rows out of {summary.conversations_in} conversations "
                f"(rejected: {dict(summary.rejected)}; rows without assistant tokens: "
                f"{summary.no_trainable_tokens}); check data.source and data.seq_length"
            )
        staged = work / "dataset"
        staged.mkdir()
        dataset, _ = load_and_preprocess_dataset(
            target_model_path=tokenizer_path,
            train_data_paths=[str(tokenized)],
            seq_length=seq_length,
            build_dataset_num_proc=1,
            seed=seed,
            token_freq_path=staged / "token_freq.pt",
            trust_remote_code=trust_remote_code,
            skip_token_freq=False,
        )
        dataset.save_to_disk(str(staged))
        summary.seconds = time.time() - t0
        (staged / "prepare_meta.json").write_text(
            json.dumps({**(meta or {}), "thinking": thinking, "seq_length": seq_length,
                        "tokenizer": tokenizer_path, "summary": summary.as_dict()}, indent=2)
        )
        _replace_dir(staged, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def _replace_dir(staged: Path, out_dir: Path) -> None:
    """Swap in the finished output (old hidden states go too: row indices changed)."""
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    staged.rename(out_dir)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
