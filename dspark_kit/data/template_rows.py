"""A conversation's training rows (input_ids + loss_mask) as the verifier's chat template renders it.

Per assistant turn j, the generation prompt of msgs[:j] and the text up to turn j are rendered
(`conversation_texts`) and their token ids turned into rows (`rows_from_ids`): one row with
several loss spans when every render is a prefix of the whole conversation's, else one row per
turn. When regen kept the verifier's own token ids of a reply (`token_ids`, from the server's
`return_token_ids`), the row trains exactly those tokens; a reply whose re-tokenized text differs
from them (a merge across the boundary, another split of the same text) is counted.

`row_thinking` decides the thinking mode a row is rendered in. prepare writes these rows; the
hidden-state storage estimate, eval's held-out split and preflight ask the same functions, so
every reader sees the rows prepare trains.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dspark_kit.data import mode_rule
from dspark_kit.data.chat import render
from dspark_kit.data.conversations import UNCLOSED, ConversationError, template_messages, truncation
from dspark_kit.data.piece_encoder import PieceEncoder
from dspark_kit.data.reasoning_formats import of_tokenizer
from dspark_kit.recipe.mixture import THINKING, choose

Row = tuple[list[int], list[int]]


@dataclass
class TurnRows:
    rows: list[Row]
    fanned: bool  # one row per turn (history re-renders differently, or the verifier's ids differ)
    differs: int = 0  # turns whose re-tokenized reply differs from the verifier's own ids


def reply_length_fn(tok):
    """span ids -> how many of them the model generated: the template's whitespace after the
    end-of-turn token (Qwen's `\\n` after `<|im_end|>`) is not generated, so it is not trained.

    speculators' own prepare-data keeps that `\\n` in the loss; we leave it out on purpose: the
    draft would learn a token the verifier never emits and teacher-forced acceptance would count
    a free hit per turn."""
    specials = set(tok.all_special_ids)
    blank: dict[int, bool] = {}

    def is_blank(i: int) -> bool:
        if i not in blank:
            blank[i] = i not in specials and tok.decode([i]).strip() == ""
        return blank[i]

    def reply_len(span: list[int]) -> int:
        k = len(span)
        while k > 0 and is_blank(span[k - 1]):
            k -= 1
        return k if 0 < k < len(span) and span[k - 1] in specials else len(span)

    return reply_len


def rows_from_ids(ids: list[list[int]], reply_len=len, encode_suffix=None,
                  generated: list[list[int] | None] | None = None,
                  cut: list[list[int] | None] | None = None) -> TurnRows:
    """Rows from the token ids of `conversation_texts` (prompt, upto per turn).

    One row when every prompt/turn render is a token prefix of the full render; else one row per
    turn (history as the template renders it at that turn, loss on that turn only). A row's context
    is always the generation prompt's own tokens: when the turn's render does not start with them
    (a merge across the boundary), the reply is encoded on its own (`encode_suffix(k)`).

    `generated[k]`: the verifier's own ids for turn k (None: not recorded). When any differs from
    the re-tokenized reply, every turn gets its own row, prompt + the verifier's ids: a turn's
    tokens cannot be both what the verifier generated and the re-rendered history it saw next.

    `cut[k]`: for a turn the verifier did not finish, the ids of its render up to where the verifier
    stopped (`cut_texts`); the turn trains only the tokens of its render that those ids share (a
    token merged across the stop is not trained either). A row whose last turn is cut ends where the
    verifier stopped: what the template adds after it (the end-of-turn token) was never in the
    verifier's context, so it gets no hidden states; a cut turn with turns after it keeps the close,
    which the verifier did read before its next reply."""
    prompts, uptos = ids[0::2], ids[1::2]
    generated = generated or [None] * len(prompts)
    cut = cut or [None] * len(prompts)
    replies = []
    for k, (p, u) in enumerate(zip(prompts, uptos)):
        if u[: len(p)] != p:
            if encode_suffix is None:
                raise ConversationError(f"turn {k}: reply tokens do not follow the generation prompt's tokens")
            u = p + encode_suffix(k)
        n = reply_len(u[len(p):])
        if cut[k] is not None:
            n = min(n, max(_shared_prefix(cut[k], u) - len(p), 0))
        replies.append((u, n))
    differs = sum(g is not None and g != u[len(p) : len(p) + n]
                  for g, p, (u, n) in zip(generated, prompts, replies))
    if differs:
        rows = [(p + (g if g is not None else u[len(p) : len(p) + n]),
                 [0] * len(p) + [1] * (len(g) if g is not None else n))
                for g, p, (u, n) in zip(generated, prompts, replies)]
        return TurnRows(rows, True, differs)
    full = uptos[-1]
    if all(full[: len(p)] == p and full[: len(u)] == u for p, u in zip(prompts, uptos)):
        mask = [0] * len(full)
        for p, (_, n) in zip(prompts, replies):
            mask[len(p) : len(p) + n] = [1] * n
        end = len(prompts[-1]) + replies[-1][1] if cut[-1] is not None else len(full)
        return TurnRows([(full[:end], mask[:end])], False)
    rows = [(u[: len(p) + n] if c is not None else u, [0] * len(p) + [1] * n + [0] * (len(u) - len(p) - n))
            for p, (u, n), c in zip(prompts, replies, cut)]
    return TurnRows([(ids, mask[: len(ids)]) for ids, mask in rows], True)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cut_texts(msgs: list[dict], texts: list[str]) -> list[str | None]:
    """Per assistant turn (conversation_texts' order): for a reply the verifier did not finish
    (finish_reason length, or reasoning never closed), its render up to the end of the verifier's
    own text; None for a finished reply. The render goes on with what the template adds (the
    end-of-turn token, a think block's close) that the verifier never wrote."""
    turns = [j for j, m in enumerate(msgs) if m["role"] == "assistant" and j > 0]
    out: list[str | None] = []
    for k, j in enumerate(turns):
        m = msgs[j]
        if m.get("finish_reason") != "length" and not m.get(UNCLOSED):
            out.append(None)
            continue
        prompt, upto = texts[2 * k], texts[2 * k + 1]
        content, reasoning = (m.get("content") or "").rstrip(), (m.get("reasoning_content") or "").rstrip()
        # the verifier stopped in its reasoning (never closed) or in its reply: the last text it wrote
        tail = reasoning if m.get(UNCLOSED) and reasoning else content or reasoning
        at = upto.rfind(tail) if tail else -1
        # not found (a template that rewrites the text): nothing of the turn is known to be the verifier's
        out.append(upto[: at + len(tail)] if at >= len(prompt) else prompt)
    return out


NO_MODE_TO_DRAW = ("no recorded thinking mode (metadata.thinking) and no metadata.idx to draw one from the "
                   "verifier.thinking mixture (regen records both)")
NOTHING_IN_SEQ_LENGTH = "no assistant token within data.seq_length (prompt too long)"
TEMPLATE_DROPS_TOOLS = ("the chat template does not render the row's `tools` (verifier.tokenizer's template has "
                        "no tools branch: use the model's own template, or drop the row's tools)")
TEMPLATE_DROPS_CALLS = ("the chat template does not render an assistant's `tool_calls` (it would train an "
                        "empty reply: use the model's own template)")
TWO_REPLIES_IN_A_ROW = ("turns {i} and {j}: two assistant turns in a row, with no user or tool turn between; "
                        "the chat template renders the second as part of the first, not as a reply to a prompt "
                        "(merge them into one reply, or put the user turn that was lost between them)")
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
    if (decision := mode_rule.decide(msgs, thinking, of_tokenizer(tok))) != mode_rule.AGREES:  # no render reproduces such a row
        raise ConversationError(decision)
    msgs = template_messages(msgs)
    texts = []
    for j in turns:
        prompt = render(tok, msgs[:j], thinking, add_generation_prompt=True, tools=tools)
        upto = render(tok, msgs[: j + 1], thinking, tools=tools)
        if not upto.startswith(prompt):
            if msgs[j - 1]["role"] == "assistant":
                raise ConversationError(TWO_REPLIES_IN_A_ROW.format(i=j - 1, j=j))
            raise ConversationError(f"turn {j}: the template does not render the reply right after its "
                                    "generation prompt (thinking mode and data disagree?)")
        texts += [prompt, upto]
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
        _check_tool_render(tok, msgs, tools, thinking, texts, turns)
    return texts


def encode_batch(tok, texts: list[str]) -> list[list[int]]:
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
    """Rows of (input_ids, loss_mask) for one conversation (rows_from_ids)."""
    texts = conversation_texts(tok, msgs, thinking, keep_truncated, tools)
    cut = encode_some(tok, cut_texts(msgs, texts))
    return rows_from_ids(encode_batch(tok, texts), reply_length_fn(tok), suffix_encoder(tok, texts),
                         generated_ids(msgs), cut)


def encode_some(tok, texts: list[str | None]) -> list[list[int] | None]:
    """encode_batch of the texts that are not None, in place."""
    got = iter(encode_batch(tok, [t for t in texts if t is not None]) if any(t is not None for t in texts) else [])
    return [None if t is None else next(got) for t in texts]


def tokenize_conversation(tok, msgs: list[dict], thinking: bool, keep_truncated: bool = False,
                          tools: list[dict] | None = None) -> tuple[list[tuple[list[int], list[int]]], bool]:
    """Rows of (input_ids, loss_mask) for one conversation, and whether it fanned out per turn."""
    t = turn_rows(tok, msgs, thinking, keep_truncated, tools)
    return t.rows, t.fanned


def suffix_encoder(tok, texts: list[str]):
    return lambda k: encode_batch(tok, [texts[2 * k + 1][len(texts[2 * k]) :]])[0]
