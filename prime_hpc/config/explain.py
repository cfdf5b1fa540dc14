"""Hydra's and OmegaConf's complaints as one line naming the key and the fix: every
exception they raise while composing is a user's mistake (an unknown key, a wrong type, an
unknown group option) and becomes a `ConfigError` or `UserError` here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from prime_hpc.config import walk
from prime_hpc.core.errors import ConfigError, UserError


def one_line(err: BaseException) -> str:
    """An exception's message on one line, without OmegaConf's trailing details."""
    text = str(err).strip()
    # OmegaConf appends a "full_key: ... object_type=..." block; keep only the message.
    text = re.split(r"\n\s*full_key:", text)[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines)


def explain(err: BaseException, conf: Optional[Path] = None) -> ConfigError | UserError:
    """Map a Hydra/OmegaConf exception (possibly wrapping another) to a one-line error;
    `conf`: the config tree, whose options an unknown group choice lists."""
    cause = err
    while cause.__cause__ is not None and not isinstance(cause, ConfigError):
        cause = cause.__cause__
    key = getattr(cause, "full_key", None) or getattr(err, "full_key", None)
    msg = one_line(cause)
    outer = one_line(err)
    m = re.search(r"Could not override '([^']+)'", outer)
    if m:
        key = m.group(1)
    if re.search(r"Key '[^']+' not in|Key '[^']+' is not in struct|not in struct", msg + outer):
        bad = key or "?"
        return ConfigError(bad, f"unknown key; {walk.valid_keys(bad)}")
    if "Could not load" in outer or "Could not find" in outer or "In '" in outer and "not found" in outer:
        return UserError(group_choice_error(outer, conf))
    if key:
        return ConfigError(str(key), msg)
    return UserError(outer)


def group_choice_error(text: str, conf: Optional[Path]) -> str:
    """'<group>=<choice>: unknown <group>; choose from ...' for Hydra's "Could not load"."""
    m = re.search(r"Could not (?:load|find) '([^/']+)/([^']+)'", text)
    if m and conf is not None:
        group, choice = m.group(1), m.group(2)
        options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
        return f"{group}={choice}: unknown {group}; choose from {', '.join(options)}"
    return text
