"""Stage 1, prepare: chat rows -> speculators' Arrow dataset + token_freq.pt.

We render with the verifier's own tokenizer and chat template (no vLLM
/render server needed), then write the `input_ids` + `loss_mask` rows in
speculators' prepared-dataset format (dataset and `token_freq.pt`) as they
come (data/speculators_dataset.py: the same result as speculators' own
pre-tokenized path, without holding the dataset in memory).

Rows are the verifier's generations in the context it saw. Messages come from
`conversations.normalize` (reasoning as `reasoning_content`, which the template
renders). Per assistant turn j the context is the generation-prompt render of
msgs[:j], token for token, and the loss is on turn j as generated: think block,
reply, end-of-turn token. When every such render is a prefix of the full
conversation's render it is one row with several loss spans; when the template
renders history differently (Qwen3 drops reasoning of turns before the last
user turn), one row per assistant turn -- the rule speculators applies with a
vLLM renderer.

Tool-calling rows: every render gets the row's `tools` (the template puts the schema where the
model saw it: Qwen3's system prompt), assistant `tool_calls` and `tool` turns go to the template
as they are, so turn j's span is its text and calls through the end-of-turn token; tool results
and the schema are context, never trained. A template that renders the schema, a call or a result
as nothing (no tool branches) rejects the row with that reason rather than training an empty reply.

Decided against speculators' own prepare-data: the template's whitespace after
the end-of-turn token (Qwen's `\\n` after `<|im_end|>`) is NOT in the loss. The
verifier stops at `<|im_end|>` and never generates it; training on it teaches a
token that is never verified and adds a free hit per turn to teacher-forced
acceptance. (It stays in input_ids as context of the next turn.)

Thinking mode per row: the mode regen generated the row in (`metadata.thinking`), else the
recipe's (`row_thinking`: verifier.thinking, or its mixture's draw for the row's `metadata.idx`),
so a mixture's rows are each trained in the context the verifier saw.

Every input row lands in one bucket: used, or rejected with its full reason
(invalid JSON, unusable row, truncated reply unless data.keep_truncated,
reasoning with thinking off, nothing trainable within seq_length).
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dspark_kit.data import mode_rule
from dspark_kit.data.chat import render
from dspark_kit.data.conversations import (
    ConversationError,
    has_reasoning,
    normalize,
    row_format,
    row_tools,
    template_messages,
    truncation,
)
from dspark_kit.data.mode_rule import REASONING_WITH_THINKING_OFF, ModeCounts  # noqa: F401 (the rule's reason, re-exported)
from dspark_kit.data.piece_encoder import PieceEncoder
from dspark_kit.data.speculators_dataset import DatasetWriter
from dspark_kit.jsonl import BadLine
from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.recipe.mixture import THINKING, choose
from dspark_kit.recipe.schema import DataCfg
from dspark_kit.stages.dataset.prepare_rows import TurnRows, reply_length_fn, rows_from_ids

_TOKENIZER = None
_REPLY_LEN = None


@dataclass
class PrepareSummary:
    """Every input row lands in one bucket: conversations_in == conversations_used + sum(rejected)."""

    conversations_in: int = 0
    conversations_used: int = 0
    rows_out: int = 0
    per_turn_rows: int = 0  # rows from conversations whose history re-renders differently
    turns_with_ids: int = 0  # replies whose own token ids regen kept (the server's return_token_ids)
    retokenized_differs: int = 0  # of those, replies whose re-tokenized text differs: trained as generated
    rejected: Counter = field(default_factory=Counter)  # full reason -> conversations
    with_reasoning: int = 0  # used conversations whose replies carry reasoning
    mode_rule: ModeCounts = field(default_factory=ModeCounts)  # rows this stage decided (data/mode_rule.py)
    mode_dropped_by_regen: int = 0  # rows regen had decided to drop (its metadata.mode_check): skipped, not judged
    thinking_rows: Counter = field(default_factory=Counter)  # "true"/"false" -> used conversations rendered so
    with_tools: int = 0  # used conversations with tool schemas or tool calls
    tool_calls: int = 0  # tool calls in used conversations' replies (trained with the reply's text)
    formats: Counter = field(default_factory=Counter)  # the reader's name of each input row's format
    no_trainable_tokens: int = 0  # turn rows cut away entirely by seq_length
    truncated: int = 0  # rows cut at seq_length
    tokens: int = 0
    trainable_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["rejected"] = dict(self.rejected.most_common())
        d["formats"] = dict(self.formats.most_common())
        d["thinking_rows"] = dict(sorted(self.thinking_rows.items()))
        d["mode_rule"] = self.mode_rule.as_dict()
        d["tokens_per_s"] = round(self.tokens / self.seconds, 1) if self.seconds else None
        return d

    def reject(self, reason: str, n: int = 1) -> None:
        self.conversations_in += n
        self.rejected[reason] += n

    def log(self, note) -> None:
        note(f"prepare: {self.conversations_used} of {self.conversations_in} conversations used -> "
             f"{self.rows_out} rows")
        if len(self.thinking_rows) > 1:
            note(f"  thinking mode on in {self.thinking_rows['true']}, off in {self.thinking_rows['false']}")
        if self.formats:
            note("  read as " + ", ".join(f"{name} ({n} rows)" for name, n in self.formats.most_common()))
        if self.with_tools:
            note(f"  {self.with_tools} conversations use tools; {self.tool_calls} tool calls trained "
                 "(tool results and schemas are context only)")
        for reason, n in self.rejected.most_common():
            note(f"  skipped {n}: {reason}")
        if self.turns_with_ids:
            note(f"  {self.turns_with_ids} replies trained on the verifier's own token ids; re-tokenizing "
                 f"their text would have changed {self.retokenized_differs}")
        if line := self.mode_rule.line():
            note(f"  {line} (decided here: no earlier stage recorded a decision)")
        if warning := self.mode_rule.warning():
            note(warning)
        if self.mode_dropped_by_regen:
            note(f"  {self.mode_dropped_by_regen} rows regen dropped for their thinking mode: skipped as it decided")


MODE_BUDGET = DataCfg.model_fields["max_mode_mismatch_fraction"].default  # the recipe's default, not a second one
DROPPED_BY_REGEN = " (decided by regen: metadata.mode_check)"
NO_MODE_TO_DRAW = ("no recorded thinking mode (metadata.thinking) and no metadata.idx to draw one from the "
                   "verifier.thinking mixture (regen records both)")
NOTHING_IN_SEQ_LENGTH = "no assistant token within data.seq_length (prompt too long)"
TEMPLATE_DROPS_TOOLS = ("the chat template does not render the row's `tools` (verifier.tokenizer's template has "
                        "no tools branch: use the model's own template, or drop the row's tools)")
TEMPLATE_DROPS_CALLS = ("the chat template does not render an assistant's `tool_calls` (it would train an "
                        "empty reply: use the model's own template)")
TEMPLATE_DROPS_RESULTS = "the chat template does not render a `tool` turn's result"


def row_thinking(row: object, thinking: bool | dict[bool, float], mixture_seed: int | None) -> bool:
    """The thinking mode a row is rendered in: the one regen generated it in (`metadata.thinking`),
    else `thinking` (verifier.thinking), a mixture's draw for the row's `metadata.idx` (its index in
    the data source; `mixture_seed`: regen.seed) by recipe.mixture.choose, as regen draws it."""
    meta = row.get("metadata") if isinstance(row, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    if isinstance(meta.get("thinking"), bool):
        return meta["thinking"]
    if not isinstance(thinking, dict):
        return thinking
    idx = meta.get("idx")
    if not isinstance(idx, int) or isinstance(idx, bool):
        raise ConversationError(NO_MODE_TO_DRAW)
    return choose(thinking, mixture_seed, THINKING, idx)


def _check_tool_render(tok, msgs: list[dict], tools: list[dict] | None, thinking: bool, texts: list[str],
                       turns: list[int]) -> None:
    """A template without tool branches renders a call as an empty reply and drops the schema
    silently: refuse the row instead (its reason names which part went missing). Each check renders
    again without the part: a template that renders it changes the text."""
    if tools and render(tok, msgs[: turns[0]], thinking, add_generation_prompt=True) == texts[0]:
        raise ConversationError(TEMPLATE_DROPS_TOOLS)
    for k, j in enumerate(turns):
        if msgs[j].get("tool_calls"):
            bare = {key: v for key, v in msgs[j].items() if key != "tool_calls"}
            if render(tok, [*msgs[:j], bare], thinking, tools=tools) == texts[2 * k + 1]:
                raise ConversationError(f"turn {j}: {TEMPLATE_DROPS_CALLS}")
    if any(m["role"] == "tool" and m["content"] not in texts[-1] for m in msgs[: turns[-1] + 1]):
        raise ConversationError(TEMPLATE_DROPS_RESULTS)


def conversation_texts(tok, msgs: list[dict], thinking: bool, keep_truncated: bool = False,
                       tools: list[dict] | None = None) -> list[str]:
    """The renders the loss mask needs: per assistant turn j, the prompt (msgs[:j] + generation
    prompt, exactly what the verifier saw) then the text up to and including turn j. Every render
    gets the row's `tools`; turn j's span is then its text and tool calls, and tool results and
    the schema stay context (they are never an assistant turn's span).

    Raises ConversationError (the reason) for a truncated reply (unless keep_truncated),
    reasoning with thinking off, or a template that does not render turn j right after its
    generation prompt: such a row is not what the verifier generated."""
    turns = [j for j, m in enumerate(msgs) if m["role"] == "assistant" and j > 0]
    if not turns:
        raise ConversationError("no assistant turn after a user turn")
    msgs = msgs[: turns[-1] + 1]  # trailing user turns have nothing to learn
    if not keep_truncated and (why := truncation(msgs)):
        raise ConversationError(why)
    if (decision := mode_rule.decide(msgs, thinking)) != mode_rule.AGREES:  # no render reproduces such a row
        raise ConversationError(decision)
    msgs = template_messages(msgs)
    texts = []
    for j in turns:
        prompt = render(tok, msgs[:j], thinking, add_generation_prompt=True, tools=tools)
        upto = render(tok, msgs[: j + 1], thinking, tools=tools)
        if not upto.startswith(prompt):
            raise ConversationError(f"turn {j}: the template does not render the reply right after its "
                                    "generation prompt (thinking mode and data disagree?)")
        texts += [prompt, upto]
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
        _check_tool_render(tok, msgs, tools, thinking, texts, turns)
    return texts


def _encode_batch(tok, texts: list[str]) -> list[list[int]]:
    """chat.encode over many texts at once (no special tokens added: the template holds them);
    text they share is encoded once (data/piece_encoder.py)."""
    return _encoder(tok)(texts)


@functools.lru_cache(maxsize=4)
def _encoder(tok) -> PieceEncoder:
    return PieceEncoder(tok)


def generated_ids(msgs: list[dict]) -> list[list[int] | None]:
    """The verifier's own token ids per assistant turn (regen keeps them), in conversation_texts' turn order."""
    return [m.get("token_ids") for j, m in enumerate(msgs) if m["role"] == "assistant" and j > 0]


def turn_rows(tok, msgs: list[dict], thinking: bool, keep_truncated: bool = False,
              tools: list[dict] | None = None) -> TurnRows:
    """Rows of (input_ids, loss_mask) for one conversation (prepare_rows.rows_from_ids)."""
    texts = conversation_texts(tok, msgs, thinking, keep_truncated, tools)
    return rows_from_ids(_encode_batch(tok, texts), reply_length_fn(tok), _suffix_encoder(tok, texts),
                         generated_ids(msgs))


def tokenize_conversation(tok, msgs: list[dict], thinking: bool, keep_truncated: bool = False,
                          tools: list[dict] | None = None) -> tuple[list[tuple[list[int], list[int]]], bool]:
    """Rows of (input_ids, loss_mask) for one conversation, and whether it fanned out per turn."""
    t = turn_rows(tok, msgs, thinking, keep_truncated, tools)
    return t.rows, t.fanned


def _suffix_encoder(tok, texts: list[str]):
    return lambda k: _encode_batch(tok, [texts[2 * k + 1][len(texts[2 * k]) :]])[0]


def _init_worker(tokenizer_path: str, trust_remote_code: bool) -> None:
    global _TOKENIZER, _REPLY_LEN
    from transformers import AutoTokenizer

    _TOKENIZER = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    _REPLY_LEN = reply_length_fn(_TOKENIZER)


def _row_result(t: TurnRows, seq_length: int) -> dict:
    kept = [{"input_ids": ids[:seq_length], "loss_mask": mask[:seq_length], "truncated": len(ids) > seq_length}
            for ids, mask in t.rows]
    return {"rows": kept, "fanned": t.fanned, "differs": t.differs}


def _work(args: tuple[list, bool | dict, int, bool, int | None]) -> list[dict]:
    """Tokenize a chunk of raw rows; one result dict per input row.

    Renders every text of the chunk first, then encodes them in one batch (the prefixes of a
    conversation share most of their text: each shared piece is encoded once)."""
    raw_rows, thinking, seq_length, keep_truncated, mixture_seed = args
    out: list[dict] = []
    planned: list[tuple[int, list[str]]] = []  # (index in out, texts)
    for raw in raw_rows:
        if isinstance(raw, BadLine):  # a jsonl line that did not parse: rejected with its reason
            out.append({"error": raw.reason})
            continue
        fmt = {"format": row_format(raw)}
        try:
            msgs, tools = normalize(raw), row_tools(raw)
            mode = row_thinking(raw, thinking, mixture_seed)
            # replies vs thinking mode: regen's recorded decision, else this stage decides (data/mode_rule.py)
            decision, by = mode_rule.recorded(raw), "regen"
            if decision is None:
                decision, by = mode_rule.decide(msgs, mode), "prepare"
                fmt["mode_rule"] = (mode, has_reasoning(msgs), decision)
            if decision != mode_rule.AGREES:
                raise ConversationError(decision + (DROPPED_BY_REGEN if by == "regen" else ""))
            planned.append((len(out), conversation_texts(_TOKENIZER, msgs, mode, keep_truncated, tools)))
            generated = generated_ids(msgs)
            calls = sum(len(m.get("tool_calls", ())) for m in msgs)
            out.append({**fmt, "thinking": mode, "reasoning": has_reasoning(msgs), "generated": generated,
                        "with_ids": sum(g is not None for g in generated),
                        "tools": bool(tools or calls), "tool_calls": calls})
        except ConversationError as e:
            out.append({**fmt, "error": str(e)})
        except Exception as e:  # noqa: BLE001 - a template that cannot render this row is a rejected row
            out.append({**fmt, "error": f"template failed: {type(e).__name__}: {e}"})
    try:
        ids = _encode_batch(_TOKENIZER, [t for _, texts in planned for t in texts])
    except Exception:  # noqa: BLE001 - one bad text must not sink the chunk: encode row by row
        ids = None
    pos = 0
    for i, texts in planned:
        try:
            row_ids = ids[pos : pos + len(texts)] if ids is not None else _encode_batch(_TOKENIZER, texts)
            t = rows_from_ids(row_ids, _REPLY_LEN, _suffix_encoder(_TOKENIZER, texts), out[i].pop("generated"))
            out[i] = {**out[i], **_row_result(t, seq_length)}
        except ConversationError as e:
            out[i] = {**_judged(out[i]), "error": str(e)}
        except Exception as e:  # noqa: BLE001 - a row the tokenizer cannot take is a rejected row
            out[i] = {**_judged(out[i]), "error": f"tokenizer failed: {type(e).__name__}: {e}"}
        pos += len(texts)
    return out


def _judged(result: dict) -> dict:
    """What a rejected row's result keeps: its format and the mode rule's decision on it."""
    return {k: result[k] for k in ("format", "mode_rule") if k in result}


def _chunks(rows: Iterable, size: int) -> Iterator[list]:
    buf: list = []
    for r in rows:
        buf.append(r)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def prepare(
    rows: Iterable,
    tokenizer_path: str,
    out_dir: Path,
    *,
    seq_length: int,
    thinking: bool | dict[bool, float],
    num_workers: int = 1,
    seed: int = 0,
    trust_remote_code: bool = False,
    total: int | None = None,
    meta: dict | None = None,
    keep_truncated: bool = False,
    pre_rejected: Counter | None = None,
    reporter: Reporter = STANDALONE,
    mixture_seed: int | None = None,
    mode_budget: float = MODE_BUDGET,
) -> PrepareSummary:
    """Tokenize `rows` and write the speculators dataset atomically to `out_dir`.

    `thinking`: verifier.thinking, for rows regen did not record a mode for (`row_thinking`;
    `mixture_seed`: regen.seed, the seed of a mixture's draw).

    `pre_rejected`: rows the reader could not use (reason -> count; it may fill while `rows` is
    read), counted in too. `mode_budget` (data.max_mode_mismatch_fraction): the share of the rows
    this stage decides by data/mode_rule.py that may be dropped before it fails."""
    summary = PrepareSummary()
    t0 = time.time()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir.parent))
    writer = None
    try:
        writer = DatasetWriter(work)
        chunks = ((c, thinking, seq_length, keep_truncated, mixture_seed) for c in _chunks(rows, 64))
        with reporter.bar("prepare", total=total, unit="conv") as bar:
            if num_workers > 1:
                pool = ProcessPoolExecutor(num_workers, initializer=_init_worker, initargs=(tokenizer_path, trust_remote_code))
                results = pool.map(_work, chunks)
            else:
                _init_worker(tokenizer_path, trust_remote_code)
                pool, results = None, map(_work, chunks)
            for chunk in results:
                out_rows = []
                for res in chunk:
                    if res.get("format"):
                        summary.formats[res["format"]] += 1
                    if "mode_rule" in res:
                        summary.mode_rule.add(*res["mode_rule"])
                    if "error" in res:
                        summary.mode_dropped_by_regen += res["error"].endswith(DROPPED_BY_REGEN)
                        summary.reject(res["error"])
                        continue
                    kept = [r for r in res["rows"] if any(r["loss_mask"])]
                    summary.no_trainable_tokens += len(res["rows"]) - len(kept)
                    if not kept:
                        summary.reject(NOTHING_IN_SEQ_LENGTH)
                        continue
                    summary.conversations_in += 1
                    summary.conversations_used += 1
                    summary.with_reasoning += res["reasoning"]
                    summary.thinking_rows[str(res["thinking"]).lower()] += 1
                    summary.with_tools += res["tools"]
                    summary.tool_calls += res["tool_calls"]
                    summary.turns_with_ids += res["with_ids"]
                    summary.retokenized_differs += res["differs"]
                    for r in kept:
                        summary.rows_out += 1
                        summary.per_turn_rows += res["fanned"]
                        summary.truncated += r["truncated"]
                        summary.tokens += len(r["input_ids"])
                        summary.trainable_tokens += sum(r["loss_mask"])
                        out_rows.append((r["input_ids"], r["loss_mask"]))
                writer.add(out_rows)
                bar.advance(len(chunk))
            if pool:
                pool.shutdown()
        for reason, n in (pre_rejected or {}).items():
            summary.reject(reason, n)
        summary.log(reporter.note)
        if verdict := summary.mode_rule.verdict(mode_budget, "prepare"):
            raise ValueError(verdict)
        if summary.rows_out == 0:
            raise ValueError(
                f"prepare: no trainable rows out of {summary.conversations_in} conversations "
                f"(rejected: {dict(summary.rejected)}; rows without assistant tokens: "
                f"{summary.no_trainable_tokens}); check data.source and data.seq_length"
            )
        staged = work / "dataset"
        writer.save(staged, seed)
        summary.seconds = time.time() - t0
        (staged / "prepare_meta.json").write_text(
            json.dumps({**(meta or {}), "thinking": thinking, "seq_length": seq_length,
                        "tokenizer": tokenizer_path, "summary": summary.as_dict()}, indent=2)
        )
        _replace_dir(staged, out_dir)
    finally:
        if writer is not None:
            writer.close()
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
