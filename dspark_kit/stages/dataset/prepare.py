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
(invalid JSON, bytes that are not UTF-8, unusable row, truncated reply unless data.keep_truncated,
reasoning with thinking off, nothing trainable within seq_length). A used row that was changed on
the way (a byte-order mark stripped, invalid UTF-8 replaced when data.invalid_utf8 asks, a reply
cut at data.seq_length) is counted by reason too; the console shows both counts, and
`<prepared>.errors.jsonl` holds one entry per dropped or changed row: where it was read
(file:line) and why.

A reply that data.seq_length cuts ends without its end-of-turn token: the verifier never produced
that text as a whole reply. By default (data.cut_replies: mask) it carries no loss; the row's
replies before it still train, and a row left with none is dropped. `train` trains it as cut.
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

from dspark_kit.data import mode_rule
from dspark_kit.data.conversations import (
    ConversationError,
    has_reasoning,
    normalize,
    row_format,
    row_tools,
)
from dspark_kit.data.mode_rule import REASONING_WITH_THINKING_OFF, ModeCounts  # noqa: F401 (the rule's reason, re-exported)
from dspark_kit.data.reasoning_formats import of_files, of_tokenizer
from dspark_kit.data.speculators_dataset import DatasetWriter
from dspark_kit.data.template_rows import (
    NOTHING_IN_SEQ_LENGTH,
    TurnRows,
    conversation_texts,
    cut_texts,
    encode_batch,
    encode_some,
    generated_ids,
    reply_length_fn,
    row_thinking,
    rows_from_ids,
    suffix_encoder,
)
from dspark_kit.jsonl import BadLine
from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.recipe.schema import DataCfg
from dspark_kit.resolved import Resolved
from dspark_kit.resolved.prepare_input import (
    CHANGED,
    WHERE,
    missing_source,
    prepare_input_rows,
    prepare_source,
)
from dspark_kit.rundir import prepare_errors_file
from dspark_kit.stages.plan import StagePlan

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
    cut_replies: int = 0  # replies cut at seq_length (masked, or trained as cut: data.cut_replies)
    changed: Counter = field(default_factory=Counter)  # full reason -> used conversations changed on the way
    errors_file: str | None = None  # one entry per dropped or changed row: where and why
    tokens: int = 0
    trainable_tokens: int = 0
    seconds: float = 0.0
    repeated_rows: int = 0  # rows equal token for token to an earlier one (greedy regen of a repeated prompt)
    val_rows: int = 0  # the rows speculators validates on: its split's last ones (train.train_data_ratio)
    val_rows_seen: int = 0  # of those, rows equal to a training row: validation figures run high on them

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["rejected"] = dict(self.rejected.most_common())
        d["changed"] = dict(self.changed.most_common())
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
        for reason, n in self.changed.most_common():
            note(f"  changed {n}: {reason}")
        if (self.rejected or self.changed) and self.errors_file:
            note(f"  each row, with its line: {self.errors_file}")
        if self.turns_with_ids:
            note(f"  {self.turns_with_ids} replies trained on the verifier's own token ids; re-tokenizing "
                 f"their text would have changed {self.retokenized_differs}")
        if line := self.mode_rule.line():
            note(f"  {line} (decided here: no earlier stage recorded a decision)")
        if warning := self.mode_rule.warning():
            note(warning)
        if self.mode_dropped_by_regen:
            note(f"  {self.mode_dropped_by_regen} rows regen dropped for their thinking mode: skipped as it decided")

    def repeats_line(self) -> str | None:
        if not self.repeated_rows:
            return None
        line = f"  {self.repeated_rows} rows repeat an earlier row token for token (kept: they weigh as many rows)"
        if self.val_rows_seen:
            line += (f"; {self.val_rows_seen} of the {self.val_rows} validation rows (the split's last, "
                     "train.train_data_ratio) repeat a training row, so the trainer's validation acceptance runs "
                     "high: `dspark-kit eval` measures held-out prompts")
        return line


MODE_BUDGET = DataCfg.model_fields["max_mode_mismatch_fraction"].default  # the recipe's default, not a second one
DROPPED_BY_REGEN = " (decided by regen: metadata.mode_check)"
def _init_worker(tokenizer_path: str, trust_remote_code: bool) -> None:
    global _TOKENIZER, _REPLY_LEN
    from transformers import AutoTokenizer

    _TOKENIZER = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    _REPLY_LEN = reply_length_fn(_TOKENIZER)


CUT_MASKED = "a reply cut at data.seq_length carries no loss (data.cut_replies: train trains it as cut)"
CUT_TRAINED = "a reply cut at data.seq_length trained as cut, without its end-of-turn token (data.cut_replies: train)"
UNFINISHED_TRAINED = ("a reply the verifier did not finish (regen.max_tokens) trained up to where it stopped, "
                      "without the end-of-turn the template adds (data.keep_truncated)")
ONLY_CUT_REPLIES = ("no reply complete within data.seq_length (a cut reply carries no loss: raise data.seq_length, "
                    "or data.cut_replies: train)")


def _row_result(t: TurnRows, seq_length: int, cut_replies: str = "mask") -> dict:
    """Rows cut at seq_length. A reply running across the cut is counted and, unless cut_replies is
    `train`, its loss masked: it was never a whole reply."""
    kept, cut = [], 0
    for ids, mask in t.rows:
        head = mask[:seq_length]
        if len(mask) > seq_length and head[-1] and mask[seq_length]:
            cut += 1
            if cut_replies == "mask":
                k = len(head)
                while k and head[k - 1]:
                    k -= 1
                head = head[:k] + [0] * (len(head) - k)
        kept.append({"input_ids": ids[:seq_length], "loss_mask": head, "truncated": len(ids) > seq_length})
    return {"rows": kept, "fanned": t.fanned, "differs": t.differs, "cut_replies": cut}


def _where(raw) -> str | None:
    if isinstance(raw, BadLine):
        return raw.where or (f"line {raw.line}" if raw.line else None)
    return raw.get(WHERE) if isinstance(raw, dict) else None


def _work(args: tuple[list, bool | dict, int, bool, int | None, str]) -> list[dict]:
    """Tokenize a chunk of raw rows; one result dict per input row.

    Renders every text of the chunk first, then encodes them in one batch (the prefixes of a
    conversation share most of their text: each shared piece is encoded once)."""
    raw_rows, thinking, seq_length, keep_truncated, mixture_seed, cut_replies = args
    out: list[dict] = []
    planned: list[tuple[int, list[str]]] = []  # (index in out, texts)
    for raw in raw_rows:
        if isinstance(raw, BadLine):  # a line that did not parse (or was not UTF-8): rejected with its reason
            out.append({"error": raw.reason, "where": _where(raw), "detail": raw.text[:200]})
            continue
        fmt = {"format": row_format(raw), "where": _where(raw),
               "changes": list(raw.get(CHANGED) or ()) if isinstance(raw, dict) else []}
        try:
            msgs, tools = normalize(raw), row_tools(raw)
            mode = row_thinking(raw, thinking, mixture_seed)
            # replies vs thinking mode: regen's recorded decision, else this stage decides (data/mode_rule.py)
            decision, by = mode_rule.recorded(raw), "regen"
            if decision is None:
                decision, by = mode_rule.decide(msgs, mode, of_tokenizer(_TOKENIZER)), "prepare"
                fmt["mode_rule"] = (mode, has_reasoning(msgs), decision)
            if decision != mode_rule.AGREES:
                raise ConversationError(decision + (DROPPED_BY_REGEN if by == "regen" else ""))
            texts = conversation_texts(_TOKENIZER, msgs, mode, keep_truncated, tools)
            planned.append((len(out), texts))
            generated = generated_ids(msgs)
            fmt["cuts"] = cut_texts(msgs, texts) if keep_truncated else None
            calls = sum(len(m.get("tool_calls", ())) for m in msgs)
            out.append({**fmt, "thinking": mode, "reasoning": has_reasoning(msgs), "generated": generated,
                        "with_ids": sum(g is not None for g in generated),
                        "tools": bool(tools or calls), "tool_calls": calls})
        except ConversationError as e:
            out.append({**fmt, "error": str(e)})
        except Exception as e:  # noqa: BLE001 - a template that cannot render this row is a rejected row
            out.append({**fmt, "error": f"template failed: {type(e).__name__}: {e}"})
    try:
        ids = encode_batch(_TOKENIZER, [t for _, texts in planned for t in texts])
    except Exception:  # noqa: BLE001 - one bad text must not sink the chunk: encode row by row
        ids = None
    pos = 0
    for i, texts in planned:
        try:
            row_ids = ids[pos : pos + len(texts)] if ids is not None else encode_batch(_TOKENIZER, texts)
            cuts = out[i].pop("cuts")
            t = rows_from_ids(row_ids, _REPLY_LEN, suffix_encoder(_TOKENIZER, texts), out[i].pop("generated"),
                              encode_some(_TOKENIZER, cuts) if cuts else None)
            unfinished = sum(c is not None for c in cuts or ())
            out[i] = {**out[i], **_row_result(t, seq_length, cut_replies), "unfinished": unfinished}
        except ConversationError as e:
            out[i] = {**_judged(out[i]), "error": str(e)}
        except Exception as e:  # noqa: BLE001 - a row the tokenizer cannot take is a rejected row
            out[i] = {**_judged(out[i]), "error": f"tokenizer failed: {type(e).__name__}: {e}"}
        pos += len(texts)
    return out


def _judged(result: dict) -> dict:
    """What a rejected row's result keeps: its format and the mode rule's decision on it."""
    return {k: result[k] for k in ("format", "mode_rule", "where", "changes") if k in result}


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
    cut_replies: str = "mask",
    errors_file: Path | None = None,
    train_ratio: float | None = None,
) -> PrepareSummary:
    """Tokenize `rows` and write the speculators dataset atomically to `out_dir`.

    `thinking`: verifier.thinking, for rows regen did not record a mode for (`row_thinking`;
    `mixture_seed`: regen.seed, the seed of a mixture's draw).

    `pre_rejected`: rows the reader could not use (reason -> count; it may fill while `rows` is
    read), counted in too. `mode_budget` (data.max_mode_mismatch_fraction): the share of the rows
    this stage decides by data/mode_rule.py that may be dropped before it fails. `cut_replies`
    (data.cut_replies): a reply seq_length cuts is masked (`mask`) or trained as cut (`train`).
    `errors_file` (default `<out_dir>.errors.jsonl`): one entry per dropped or changed row, replaced
    with the dataset, or when a verdict fails the run (it says why); a run interrupted or crashed
    leaves the previous file as it was, beside the dataset it describes. `train_ratio`
    (train.train_data_ratio): count the rows that repeat another and the validation rows that repeat
    a training row, and say so."""
    summary = PrepareSummary()
    summary.mode_rule.always_reasons = getattr(of_files(str(tokenizer_path)), "always", False)  # (mode_rule.py)
    t0 = time.time()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir.parent))
    errors_path = Path(errors_file or prepare_errors_file(out_dir))
    summary.errors_file = str(errors_path)
    errors = (work / "errors.jsonl").open("w", encoding="utf-8")

    def entry(res: dict, action: str, reason: str) -> None:
        errors.write(json.dumps({"where": res.get("where"), "action": action, "reason": reason,
                                 **({"detail": res["detail"]} if res.get("detail") else {})},
                                ensure_ascii=False) + "\n")

    writer, publish = None, False
    try:
        writer = DatasetWriter(work)
        chunks = ((c, thinking, seq_length, keep_truncated, mixture_seed, cut_replies) for c in _chunks(rows, 64))
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
                        entry(res, "dropped", res["error"])
                        continue
                    kept = [r for r in res["rows"] if any(r["loss_mask"])]
                    summary.no_trainable_tokens += len(res["rows"]) - len(kept)
                    summary.cut_replies += res["cut_replies"]
                    if not kept:
                        why = ONLY_CUT_REPLIES if res["cut_replies"] and cut_replies == "mask" else NOTHING_IN_SEQ_LENGTH
                        summary.reject(why)
                        entry(res, "dropped", why)
                        continue
                    changes = res["changes"] + ([CUT_MASKED if cut_replies == "mask" else CUT_TRAINED]
                                                if res["cut_replies"] else []) + (
                        [UNFINISHED_TRAINED] if res.get("unfinished") else [])
                    for why in changes:
                        summary.changed[why] += 1
                        entry(res, "changed", why)
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
            entry({}, "dropped", f"{reason} ({n} rows, read before prepare)")
        summary.log(reporter.note)
        verdict = summary.mode_rule.verdict(mode_budget, "prepare") or (None if summary.rows_out else (
            f"prepare: no trainable rows out of {summary.conversations_in} conversations "
            f"(rejected: {dict(summary.rejected)}; rows without assistant tokens: "
            f"{summary.no_trainable_tokens}); check data.source and data.seq_length"))
        if verdict:
            publish = True  # every row is accounted for: the run fails with the file that says why
            raise ValueError(verdict)
        staged = work / "dataset"
        writer.save(staged, seed)
        if train_ratio is not None:
            summary.repeated_rows, summary.val_rows, summary.val_rows_seen = DatasetWriter.repeats(staged, train_ratio)
            if line := summary.repeats_line():
                reporter.note(line)
        summary.seconds = time.time() - t0
        (staged / "prepare_meta.json").write_text(
            json.dumps({**(meta or {}), "thinking": thinking, "seq_length": seq_length,
                        "tokenizer": tokenizer_path, "summary": summary.as_dict()}, indent=2)
        )
        _replace_dir(staged, out_dir)
        publish = True  # with the dataset it describes, never beside an older one
    finally:
        if writer is not None:
            writer.close()
        errors.close()
        if publish:  # with the dataset, or with a verdict that failed the run; not after a crash
            (work / "errors.jsonl").replace(errors_path)
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


# ---- the stage ---------------------------------------------------------------


def plan(res: Resolved) -> StagePlan:
    src, out = prepare_source(res), res.run.prepared
    missing = missing_source(res)
    return StagePlan.of(res, "prepare", [f"# in-process: tokenize {src} with {res.recipe.verifier.path}'s chat template -> {out}",
                                         *([missing] if missing else [])],
                        inputs={"rows": src, "verifier": res.recipe.verifier.path},
                        outputs={"prepared": str(out), "errors": str(prepare_errors_file(out))})


def run(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    recipe = res.recipe
    rows, total, unusable, source = prepare_input_rows(res)
    s = prepare(
        rows, res.verifier_path, plan.outputs["prepared"],
        seq_length=recipe.data.seq_length, thinking=recipe.verifier.thinking, errors_file=plan.outputs.get("errors"),
        num_workers=recipe.data.num_workers, seed=recipe.train.seed,
        trust_remote_code=recipe.verifier.trust_remote_code, total=total,
        keep_truncated=recipe.data.keep_truncated, pre_rejected=unusable, cut_replies=recipe.data.cut_replies,
        meta={"verifier": recipe.verifier.path, "source": source}, reporter=reporter, mixture_seed=recipe.mixture_seed,
        mode_budget=recipe.data.max_mode_mismatch_fraction, train_ratio=recipe.train.train_data_ratio,
    )
    return s.as_dict()
