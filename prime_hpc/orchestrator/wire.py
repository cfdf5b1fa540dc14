"""`Rollout`s as JSON, for an env server's answers (`prime_hpc.envserver`).

`rollout_to_json` gives a plain dict of every field (its branches as dicts, the `generated`
span as a two-item list or None); `rollout_from_json` gives back an equal `Rollout`:
`rollout_from_json(json.loads(json.dumps(rollout_to_json(r)))) == r` for any rollout whose
values JSON can hold (example ids, metrics and messages as verifiers gives them). Pure
functions, no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from prime_hpc.orchestrator.rollouts import Branch, Rollout

_ROLLOUT_FIELDS = {f.name for f in fields(Rollout)}
_BRANCH_FIELDS = {f.name for f in fields(Branch)}


def rollout_to_json(r: Rollout) -> dict:
    """Every field of `r` as plain JSON-able data."""
    out = asdict(r)
    out["generated"] = list(r.generated) if r.generated is not None else None
    return out


def rollout_from_json(obj: dict) -> Rollout:
    """The `Rollout` `rollout_to_json` gave `obj` for; ValueError naming a field it does not know."""
    unknown = set(obj) - _ROLLOUT_FIELDS
    if unknown:
        raise ValueError(f"a rollout has unknown fields: {', '.join(sorted(unknown))}")
    kw: dict[str, Any] = dict(obj)
    branches = []
    for b in kw.get("branches") or []:
        extra = set(b) - _BRANCH_FIELDS
        if extra:
            raise ValueError(f"a branch has unknown fields: {', '.join(sorted(extra))}")
        branches.append(Branch(**b))
    kw["branches"] = branches
    span = kw.get("generated")
    kw["generated"] = (float(span[0]), float(span[1])) if span is not None else None
    return Rollout(**kw)


def group_to_json(rollouts: list[Rollout]) -> list[dict]:
    return [rollout_to_json(r) for r in rollouts]


def group_from_json(items: list[dict]) -> list[Rollout]:
    return [rollout_from_json(x) for x in items]
