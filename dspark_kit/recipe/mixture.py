"""Per-row mixtures: a recipe value given as weights over values (issue 31).

`verifier.thinking: {true: 0.7, false: 0.3}` or `regen.temperature: {0.0: 0.5, 0.7: 0.5}` gives
each row one value, drawn from the weights by `choose`, the one function that decides a row's
value: regen sends it and records it in the row's metadata, prepare renders a row that has no
record in the mode `choose` gives it. The draw is a stable hash of (what, seed, row index), never
Python's per-process `hash()`, so a resumed regen, another machine and prepare all agree. A plain
value (`true`, `0.0`) is a mixture of one and is kept as it is typed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

THINKING = "thinking"  # the `what` of each draw: the two mixtures draw independently
TEMPERATURE = "temperature"


def _weight(shown: str, w: object, example: str) -> float:
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
        raise ValueError(f"weight {w!r} for {shown} is not a number; give each value a weight >= 0, e.g. {example}")
    if w < 0:
        raise ValueError(f"weight {w} for {shown} is negative; weights are >= 0, e.g. {example}")
    return float(w)


def parse_weights(value: object, parse_key: Callable[[object], Any], example: str) -> object:
    """A plain value or a mixture as typed (YAML, `--set`, a recorded recipe's JSON with string keys):
    the value, or {value: weight}. `parse_key` turns a typed value into the value or raises
    ValueError naming what values are allowed."""
    if not isinstance(value, dict):
        try:
            return parse_key(value)
        except ValueError as e:
            raise ValueError(f"{e}; or weights per row, e.g. {example}") from None
    out: dict[Any, float] = {}
    for k, w in value.items():
        try:
            key = parse_key(k)
        except ValueError as e:
            raise ValueError(f"{e}; the weights' keys are such values, e.g. {example}") from None
        shown = str(key).lower() if isinstance(key, bool) else repr(key)
        if key in out:
            raise ValueError(f"the weights name {shown} twice; give each value once, e.g. {example}")
        out[key] = _weight(shown, w, example)
    if not any(out.values()):
        raise ValueError(f"the weights are all zero (or none are given); give at least one value a weight > 0, "
                         f"e.g. {example}")
    return out


def thinking_key(k: object) -> bool:
    """A thinking mode as typed: what the plain boolean field always took (true/false, yes/no,
    on/off, 1/0, and the strings a recorded recipe's JSON keys carry)."""
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(bool).validate_python(k)
    except ValidationError:
        raise ValueError(f"unknown mode {k!r}: a thinking mode is true or false") from None


def temperature_key(k: object) -> float:
    """A temperature as typed: a number >= 0 (a recorded recipe's JSON keys are strings of one)."""
    try:
        t = float(k) if not isinstance(k, bool) else math.nan
    except (TypeError, ValueError):
        t = math.nan
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"unknown temperature {k!r}: a temperature is a number >= 0")
    return t


def _draw(seed: int | None, what: str, idx: int | str) -> float:
    """A number in [0, 1) fixed by (what, seed, idx) on every machine and in every process."""
    digest = hashlib.blake2b(f"{what}\0{seed}\0{idx}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def choose(value: Any, seed: int | None, what: str, idx: int | str) -> Any:
    """The value row `idx` gets: `value` itself when it is not a mixture, else one of the
    mixture's values with probability proportional to its weight (`seed`: regen.seed; `what`:
    THINKING or TEMPERATURE). Values are taken in sorted order, so the keys' order in the
    YAML does not change a row's draw."""
    if not isinstance(value, dict):
        return value
    items = sorted((v, w) for v, w in value.items() if w > 0)
    total = sum(w for _, w in items)
    u, acc = _draw(seed, what, idx) * total, 0.0
    for v, w in items:
        acc += w
        if u < acc:
            return v
    return items[-1][0]  # u within rounding of the total


def support(value: Any) -> list:
    """The values rows can get (sorted): those with a weight > 0, or the plain value."""
    return sorted(v for v, w in value.items() if w > 0) if isinstance(value, dict) else [value]


def most_likely(value: Any) -> Any:
    """The plain value, or the mixture's heaviest one (a tie goes to the larger value: thinking on)."""
    return max(value.items(), key=lambda kv: (kv[1], kv[0]))[0] if isinstance(value, dict) else value
