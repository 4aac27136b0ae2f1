"""prepare's loss-mask rule written the plain way, with transformers' own calls: render and
encode every prefix on its own. tests/test_prepare_fast_path.py and benchmarks/bench_prepare.py
hold prepare's batched path (fast render, shared pieces encoded once) to it."""

from __future__ import annotations

from dspark_kit.data.conversations import template_messages


def render(tok, msgs, thinking, add_generation_prompt=False) -> str:
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   enable_thinking=thinking)


def encode(tok, text) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def reference_rows(tok, msgs, thinking):
    """Loss on each reply up to and including its end-of-turn token (the template's newline
    after it is not generated); one row when every prefix is a token prefix of the full
    conversation, else one row per turn: the generation prompt's tokens, then the reply."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def reply_n(span):
        if eos in span:
            end = len(span) - span[::-1].index(eos)
            if tok.decode(span[end:]).strip() == "":
                return end
        return len(span)

    turns = [j for j, m in enumerate(msgs) if m["role"] == "assistant" and j > 0]
    msgs = template_messages(msgs[: turns[-1] + 1])
    full = encode(tok, render(tok, msgs, thinking))
    texts = [(render(tok, msgs[:j], thinking, add_generation_prompt=True), render(tok, msgs[: j + 1], thinking))
             for j in turns]
    pairs = [(encode(tok, pt), encode(tok, ut)) for pt, ut in texts]
    if all(full[: len(p)] == p and full[: len(u)] == u for p, u in pairs):
        mask = [0] * len(full)
        for p, u in pairs:
            n = reply_n(u[len(p):])
            mask[len(p) : len(p) + n] = [1] * n
        return [(full, mask)]
    rows = []
    for (p, u), (pt, ut) in zip(pairs, texts, strict=True):
        if u[: len(p)] != p:
            u = p + encode(tok, ut[len(pt):])
        n = reply_n(u[len(p):])
        rows.append((u, [0] * len(p) + [1] * n + [0] * (len(u) - len(p) - n)))
    return rows
