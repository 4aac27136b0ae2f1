"""Chat-template rendering shared by prepare, regen, eval and the local engine.

One place decides how messages become text and tokens, so every stage uses the
same template and the same thinking mode (docs/PITFALLS.md, pitfall 4).
"""

from __future__ import annotations


def render(tokenizer, messages: list[dict], thinking: bool, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=thinking,
    )


def encode(tokenizer, text: str) -> list[int]:
    # The template already holds every special token: add none.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer, messages: list[dict], thinking: bool) -> list[int]:
    """Token ids of the conversation so far plus the assistant generation prompt."""
    return encode(tokenizer, render(tokenizer, messages, thinking, add_generation_prompt=True))
