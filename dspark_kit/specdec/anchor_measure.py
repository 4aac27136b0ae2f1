"""Measure a draft's anchor layout when its config does not say it: decode a handful of prompts
in-process with each layout (the kit's reference decoder, greedy, on the verifier) and compare the
acceptance lengths. Trained one way and drafted the other, a draft predicts the token one position
off, so the wrong layout accepts next to nothing (acceptance length near 1) and the choice is plain.
"""

from __future__ import annotations

from pathlib import Path

# generic prompts for a real verifier; a rehearsal passes its own (`dspark-kit import --prompts`)
DEFAULT_CHATS = [[{"role": "user", "content": text}] for text in (
    "Explain in three sentences why the sky is blue.",
    "Write a short Python function that returns the n-th Fibonacci number.",
    "List five fruits and one fact about each.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What is 17 times 23? Show the steps.",
    "Translate 'good morning, how are you?' into French and Spanish.",
)]
NUM_PROMPTS = 6
MAX_NEW_TOKENS = 32


def read_chats(path: Path) -> list[list[dict]]:
    """`--prompts`: jsonl rows with conversations / messages / prompt (a plain text line is a prompt),
    as eval reads them; a bad file or row is a ValueError naming it."""
    from dspark_kit.data.conversations import ConversationError, normalize, template_messages
    from dspark_kit.jsonl import BadLine, read_jsonl

    try:
        rows = list(read_jsonl(Path(path), errors="strict"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts {path}: unreadable ({type(e).__name__}); pass a UTF-8 jsonl of chats") from None
    chats = []
    for i, row in enumerate(rows):
        try:
            chats.append(template_messages(normalize({"prompt": row.text} if isinstance(row, BadLine) else row)))
        except ConversationError as e:
            raise ValueError(f"--prompts {path} line {i + 1}: {e}") from None
    if not chats:
        raise ValueError(f"--prompts {path}: no rows")
    return chats


def measure_layouts(candidates: dict[bool, Path], verifier: str | Path, chats: list[list[dict]] | None = None,
                    num_prompts: int = NUM_PROMPTS, max_new_tokens: int = MAX_NEW_TOKENS, thinking: bool = False,
                    device: str = "cpu") -> dict[str, float]:
    """{"true": AL, "false": AL}: greedy acceptance length (1 + accepted / drafts, vLLM's figure) of
    each candidate checkpoint (the same draft written with sample_from_anchor true / false), each at
    its full slot count, on the first `num_prompts` chats (up to their last user turn)."""
    from transformers import AutoTokenizer

    from dspark_kit.data.chat import prompt_ids
    from dspark_kit.specdec.decoder import SpecGenerator, Verifier
    from dspark_kit.specdec.draft_model import DSparkDraft

    tokenizer = AutoTokenizer.from_pretrained(str(verifier))
    chats = chats or DEFAULT_CHATS
    prompts = []
    for chat in chats[:num_prompts]:
        last = max(i for i, m in enumerate(chat) if m.get("role") == "user")
        prompts.append(prompt_ids(tokenizer, chat[: last + 1], thinking))
    stop = frozenset(t for t in [tokenizer.eos_token_id] if t is not None)
    out, tap = {}, None
    for value, ckpt in candidates.items():
        draft = DSparkDraft.load(ckpt, verifier, device, sample_from_anchor=value)
        if tap is None:  # one verifier for both: the candidates read the same layers
            tap = Verifier(verifier, draft.target_layer_ids, device, "float32")
        gen = SpecGenerator(tap, draft, draft.slots)
        drafts = accepted = 0
        for ids in prompts:
            r = gen.generate(ids, max_new_tokens, stop_ids=stop)
            drafts, accepted = drafts + r.num_drafts, accepted + r.num_accepted_tokens
        out[str(value).lower()] = round(1.0 + accepted / drafts, 4) if drafts else 1.0
    return out
