"""Chat-template rendering shared by prepare, regen, eval and the local engine.

One place decides how messages become text and tokens, so every stage uses the
same template and the same thinking mode (docs/PITFALLS.md, pitfall 4).

`render` gives exactly `tokenizer.apply_chat_template(..., tokenize=False)`, but
calls the compiled template itself: prepare renders every prefix of every
conversation, and most of a render's time was the call's wrapping and the
sandbox re-checking the same attribute of the same type (`str.strip`, `loop.last`)
on every access. The sandbox stays; its verdict, which depends only on the
object's type and the attribute's name, is remembered.
"""

from __future__ import annotations

import functools

_DICT_ATTRIBUTES = frozenset(dir(dict))  # all a plain dict instance has


def render(tokenizer, messages: list[dict], thinking: bool, add_generation_prompt: bool = False,
           tools: list[dict] | None = None) -> str:
    """`tools`: the conversation's tool schemas (OpenAI's `tools`), rendered where the template puts
    them (Qwen3: the system prompt); every render of a tool-calling conversation must get them."""
    template = _compiled_template(tokenizer) if messages else None
    if template is None:  # no template of its own, or transformers' internals moved: the public call
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=thinking,
        )
    # the arguments apply_chat_template passes: special tokens first, our kwargs over them
    kwargs = {**tokenizer.special_tokens_map, "enable_thinking": thinking}
    return template.render(messages=messages, tools=tools, documents=None,
                           add_generation_prompt=add_generation_prompt, **kwargs)


def _compiled_template(tokenizer):
    try:
        source = tokenizer.get_chat_template(None, None)
    except (AttributeError, ValueError):
        return None
    return _compile(source) if isinstance(source, str) else None


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """transformers' own compiled template (same environment, filters and globals), a private
    copy so remembering the sandbox's verdicts touches no one else's template."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from transformers.utils.chat_template_utils import _cached_compile_jinja_template
    except ImportError:
        return None
    template = _cached_compile_jinja_template(source)
    env = template.environment
    # jinja 3's check reads only type(obj) and the attribute's name (never the value)
    if type(env) is ImmutableSandboxedEnvironment and jinja2.__version__.startswith("3."):
        check, sandbox_getattr, verdicts = env.is_safe_attribute, env.getattr, {}

        def is_safe_attribute(obj, attr, value):
            key = (type(obj), attr)
            if key not in verdicts:
                verdicts[key] = check(obj, attr, value)
            return verdicts[key]

        def getattr_(obj, attribute):
            # `message.content`: a plain dict has no attribute of that name, so the sandbox's lookup
            # raises and falls back to the key; go to the key directly (same result, no exception)
            if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
                try:
                    return obj[attribute]
                except LookupError:
                    return env.undefined(obj=obj, name=attribute)
            return sandbox_getattr(obj, attribute)

        env.is_safe_attribute, env.getattr = is_safe_attribute, getattr_
    return template


def encode(tokenizer, text: str) -> list[int]:
    # The template already holds every special token: add none.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer, messages: list[dict], thinking: bool) -> list[int]:
    """Token ids of the conversation so far plus the assistant generation prompt."""
    return encode(tokenizer, render(tokenizer, messages, thinking, add_generation_prompt=True))


def stop_token_ids(tokenizer, model_dir: str | None = None) -> frozenset[int]:
    """The ids that end a reply, decided as vLLM decides them: the tokenizer's eos token plus the
    verifier's generation_config.json `eos_token_id` (an id or a list: Llama-3's <|end_of_text|>,
    <|eom_id|> and <|eot_id|>; Qwen3's <|im_end|> and <|endoftext|>)."""
    import json
    from pathlib import Path

    ids = [tokenizer.eos_token_id]
    if model_dir:
        try:
            eos = json.loads((Path(model_dir) / "generation_config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            eos = None
        ids += eos if isinstance(eos, list) else [eos]
    return frozenset(i for i in ids if isinstance(i, int) and i >= 0)
