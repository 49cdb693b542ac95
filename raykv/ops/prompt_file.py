"""Prompt files of ``raykv warm``: one prompt per line.

A line is one of:

- a JSON list of token ids (``[1, 2, 3]``): sent as token ids, exactly;
- a JSON string (``"You are...\\nTools: ..."``): text with escapes, for
  prompts that span lines or begin with ``[`` or ``"``;
- anything else: the line itself as text (without its line break).

Blank lines (only white space) are skipped. A line that starts with ``[`` or
``"`` but is not valid JSON of its kind is an error (``ConfigError`` naming
the line), never sent as text by accident.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from raykv.core.validate import ConfigError

#: One prompt: text, or token ids.
Prompt = str | list[int]


def parse_line(line: str, where: str) -> Prompt | None:
    """The prompt of one line (None for a blank one); ``where`` names it in errors."""
    text = line.rstrip("\r\n")
    stripped = text.strip()
    if not stripped:
        return None
    if stripped[0] not in '["':
        return text
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError as e:
        raise ConfigError(where, f'not valid JSON ({e.msg}); a line starting with [ or " must be JSON') from None
    if isinstance(value, str):
        if not value:
            raise ConfigError(where, "an empty prompt")
        return value
    if not isinstance(value, list) or not value:
        raise ConfigError(where, "a token-id line must be a non-empty JSON list of integers")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ConfigError(where, "token ids must be integers >= 0")
    return value


def parse_prompts(lines: Iterable[str], source: str = "prompts") -> list[Prompt]:
    """The prompts of ``lines`` (``source`` names them in errors); ``ConfigError`` when there are none."""
    prompts = [p for n, line in enumerate(lines, 1) if (p := parse_line(line, f"{source}:{n}")) is not None]
    if not prompts:
        raise ConfigError(source, "no prompts (one per line: text, a JSON string, or a JSON list of token ids)")
    return prompts


def read_prompts(path: str) -> list[Prompt]:
    """The prompts of the file at ``path`` (UTF-8); ``ConfigError`` when it cannot be read or holds none."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("--prompt-file", f"cannot read {path!r}: {getattr(e, 'strerror', None) or e}") from None
    return parse_prompts(text.splitlines(), path)
