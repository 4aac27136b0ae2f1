"""A recipe written as YAML lines with a comment per derived key (`dspark-kit init`)."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml


class CommentedYaml:
    """Recipe sections as YAML lines with a comment per derived key."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.derived: list[tuple[str, str, str]] = []  # (section.key, value, short source) for the table
        self._current = ""

    def top(self, key: str, value: Any, note: str = "") -> None:
        self.lines.append(line(key, value, note, indent=""))

    def section(self, name: str, note: str = "") -> None:
        self.lines.append(f"{name}:" + (f"  # {note}" if note else ""))
        self._current = name

    def key(self, key: str, value: Any, note: str = "", show: str | None = None) -> None:
        """One key; `show` puts it in the printed table with that (short) source."""
        self.lines.append(line(key, value, note, indent="  "))
        if show is not None:
            self.derived.append((f"{self._current}.{key}", flow_value(value), show))


PLAIN = re.compile(r"[A-Za-z0-9_./:@+-]+")


def flow_value(value: Any) -> str:
    """A YAML flow value: plain when it reads back as the same string, JSON otherwise (valid YAML)."""
    if isinstance(value, str) and PLAIN.fullmatch(value) and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)


def line(key: str, value: Any, note: str, indent: str) -> str:
    text = f"{indent}{key}: {flow_value(value)}"
    return f"{text}  # {note}" if note else text
