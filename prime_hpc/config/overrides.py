"""Command-line overrides written by prime-hpc itself (a warm-up's output_dir, a resumed
run's step): any value, quoted for Hydra's override grammar."""

from __future__ import annotations

import re


def override(key: str, value: object) -> str:
    """`key=value` as a Hydra override, the value quoted so any characters survive (in a
    quoted value only the backslashes before a quote or at the end are escapes)."""
    text = re.sub(r"(\\+)('|$)", lambda m: m.group(1) * 2 + m.group(2), str(value))
    return f"{key}='" + text.replace("'", "\\'") + "'"
