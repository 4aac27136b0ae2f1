"""One redaction for every command line, env and argv the kit prints, logs or records.

What counts as a secret: the value of an environment variable whose name contains
KEY, TOKEN, SECRET or PASSWORD (also PASSWD, CREDENTIAL); the value after a flag
such as --api-key / --token / --hf-token / --password (both `--flag VALUE` and
`--flag=VALUE`); and anything that looks like an API key (sk-..., hf_..., ghp_...,
Bearer ...). Redacted values become `***`. Use `redact_text` on free text (error
messages, logs), `redact_argv` / `redact_env` on structured commands.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
_WORD = r"(?:api[-_]?key|key|token|secret|passw(?:or)?d|credentials?)"
# env var / mapping key names: the word delimited by _ or the ends (HF_TOKEN, OPENAI_API_KEY,
# AWS_SECRET_ACCESS_KEY), not TOKENIZERS_PARALLELISM or max_tokens
SECRET_NAME_RE = re.compile(rf"(?:^|[_-]){_WORD}(?:$|[_-])", re.IGNORECASE)
# flags ending in the word: --api-key, --hf-token, --token, --password (not --max-tokens, --mask-token-id)
SECRET_FLAG_RE = re.compile(rf"^--?(?:[A-Za-z0-9]+[-_])*{_WORD}$", re.IGNORECASE)
# values that look like credentials wherever they appear
SECRET_VALUE_RE = re.compile(
    r"(?<![A-Za-z0-9])(?:sk-[A-Za-z0-9_\-]{6,}|sk_[A-Za-z0-9_\-]{6,}|hf_[A-Za-z0-9]{10,}"
    r"|gh[pousr]_[A-Za-z0-9]{10,}|xox[abp]-[A-Za-z0-9\-]{10,}|AKIA[0-9A-Z]{16})")
_ENV_ASSIGN_RE = re.compile(r"(?P<name>(?<![A-Za-z0-9_-])[A-Za-z_][A-Za-z0-9_]*)="
                            r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s'\"]+)")
_FLAG_TEXT_RE = re.compile(
    rf"(?P<flag>(?<![A-Za-z0-9_-])--?(?:[A-Za-z0-9]+[-_])*{_WORD})"
    r"(?P<sep>=|\s+)(?P<value>'[^']*'|\"[^\"]*\"|[^\s'\"]+)", re.IGNORECASE)
_BEARER_RE = re.compile(r"(Bearer\s+)[^\s'\"]+", re.IGNORECASE)


_FIELD_END_RE = re.compile(rf"(?:^|[_-]){_WORD}$", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """An environment variable name that holds a secret (HF_TOKEN, AWS_SECRET_ACCESS_KEY)."""
    return bool(SECRET_NAME_RE.search(name))


def is_secret_field(name: str) -> bool:
    """A mapping key that holds a secret: env-style names as above, others only when they end in
    the word (api_key, hf_token; not token_freq or mask_token_id)."""
    return is_secret_name(name) if name.isupper() else bool(_FIELD_END_RE.search(name))


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (MASK if is_secret_name(k) and v else redact_text(v)) for k, v in env.items()}


def redact_argv(argv: list[str]) -> list[str]:
    out: list[str] = []
    hide_next = False
    for arg in argv:
        arg = str(arg)
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        flag, eq, _value = arg.partition("=")
        if SECRET_FLAG_RE.match(flag):
            if eq:
                out.append(f"{flag}={MASK}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(redact_text(arg))
    return out


def redact_text(text: str) -> str:
    """Secrets in free text: NAME=VALUE for secret-looking names, --secret-flag VALUE, sk-... values."""
    if not text:
        return text

    def env_sub(m: re.Match) -> str:
        return f"{m['name']}={MASK}" if is_secret_field(m["name"]) else m[0]

    text = _ENV_ASSIGN_RE.sub(env_sub, text)
    text = _FLAG_TEXT_RE.sub(lambda m: f"{m['flag']}{m['sep']}{MASK}", text)
    text = _BEARER_RE.sub(lambda m: m[1] + MASK, text)
    return SECRET_VALUE_RE.sub(MASK, text)


def redact_obj(obj: Any) -> Any:
    """A JSON-like value with secrets redacted (manifests, recipes recorded to disk)."""
    if isinstance(obj, dict):
        return {k: (MASK if isinstance(k, str) and is_secret_field(k) and isinstance(v, str) and v
                    else redact_obj(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        if all(isinstance(x, str) for x in obj):
            return redact_argv(obj)
        return [redact_obj(x) for x in obj]
    if isinstance(obj, str):
        return redact_text(obj)
    return obj
