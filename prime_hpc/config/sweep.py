"""Sweeps (`prime-hpc submit -m a=1,2 b=x,y`): Hydra's sweep syntax expanded into one plain
override list per run."""

from __future__ import annotations

from typing import Sequence

from prime_hpc.core.errors import UserError


def expand_sweep(overrides: Sequence[str]) -> list[list[str]]:
    """Expand Hydra sweep syntax (`a=1,2 b=x,y`, `range(...)`, `choice(...)`) into the
    cartesian product of plain override lists, in Hydra's order."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from prime_hpc.config.explain import one_line

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:
        raise UserError(one_line(e)) from None
    axes: list[list[str]] = []
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override():
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([str(o.input_line)])
    return [list(combo) for combo in itertools.product(*axes)]


def swept(point: Sequence[str], overrides: Sequence[str]) -> str:
    """What a sweep point sets differently from the others (its legend)."""
    return " ".join(o for o in point if o not in overrides)
