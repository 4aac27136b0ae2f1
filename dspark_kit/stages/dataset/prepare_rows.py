"""Training rows (input_ids + loss_mask) from the token ids of a conversation's renders.

prepare renders, per assistant turn j, the generation prompt of msgs[:j] and the text up
to turn j (prepare.conversation_texts); this module turns their token ids into rows. When
regen kept the verifier's own token ids of a reply (`token_ids`, from the server's
`return_token_ids`), the row trains exactly those tokens; a reply whose re-tokenized text
differs from them (a merge across the boundary, another split of the same text) is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_kit.data.conversations import ConversationError

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
                  generated: list[list[int] | None] | None = None) -> TurnRows:
    """Rows from the token ids of `conversation_texts` (prompt, upto per turn).

    One row when every prompt/turn render is a token prefix of the full render; else one row per
    turn (history as the template renders it at that turn, loss on that turn only). A row's context
    is always the generation prompt's own tokens: when the turn's render does not start with them
    (a merge across the boundary), the reply is encoded on its own (`encode_suffix(k)`).

    `generated[k]`: the verifier's own ids for turn k (None: not recorded). When any differs from
    the re-tokenized reply, every turn gets its own row, prompt + the verifier's ids: a turn's
    tokens cannot be both what the verifier generated and the re-rendered history it saw next."""
    prompts, uptos = ids[0::2], ids[1::2]
    generated = generated or [None] * len(prompts)
    replies = []
    for k, (p, u) in enumerate(zip(prompts, uptos)):
        if u[: len(p)] != p:
            if encode_suffix is None:
                raise ConversationError(f"turn {k}: reply tokens do not follow the generation prompt's tokens")
            u = p + encode_suffix(k)
        replies.append((u, reply_len(u[len(p):])))
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
        for p, u in zip(prompts, uptos):
            n = reply_len(full[len(p) : len(u)])
            mask[len(p) : len(p) + n] = [1] * n
        return TurnRows([(full, mask)], False)
    rows = [(u, [0] * len(p) + [1] * n + [0] * (len(u) - len(p) - n)) for p, (u, n) in zip(prompts, replies)]
    return TurnRows(rows, True)
