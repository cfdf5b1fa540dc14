"""A run's vital signs, read from the tails of its metrics files: how far it is, whether
the reward moves, the latest eval, loss, mismatch KL, seconds per step, throughput and an
ETA. What `prime-hpc status` prints (and `--json` returns). Pure and light: reads at most
`TAIL_BYTES` of each metrics file, imports nothing heavy.
"""

from __future__ import annotations

import time
from statistics import mean
from typing import Any, Optional

from prime_hpc.rundir import RunDir, read_rows
from prime_hpc.rundir.drops import Drop

TAIL_BYTES = 256 * 1024  # per metrics file: enough for ~hundreds of recent steps
TREND_WINDOW = 10  # reward trend: mean of the last N steps against the N before
SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def _last(rows: list[dict], key: str) -> Optional[tuple[int, float]]:
    for row in reversed(rows):
        if isinstance(row.get(key), (int, float)):
            return row["step"], float(row[key])
    return None


def _series(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def vitals(
    run: RunDir, max_steps: Optional[int] = None, now: Optional[float] = None, ended: bool = False
) -> dict[str, Any]:
    """Vital signs of `run` (keys with None when unknown). `max_steps` from its config;
    `ended`: the job is over, so there is no ETA (an SFT run may stop early)."""
    now = time.time() if now is None else now
    trainer, orch = (read_rows(run.metrics(c), TAIL_BYTES) for c in ("trainer", "orchestrator"))
    out: dict[str, Any] = {"max_steps": max_steps}
    steps = [r["step"] for r in trainer if "loss/mean" in r]
    out["trainer_step"] = steps[-1] if steps else None
    orch_steps = [r["step"] for r in orch if "reward/all/mean" in r]
    out["orchestrator_step"] = orch_steps[-1] if orch_steps else None
    out["unfilled"] = unfilled(orch, out["orchestrator_step"])
    rewards = _series(orch, "reward/all/mean")
    out["reward"] = rewards[-1] if rewards else None
    recent, before = rewards[-TREND_WINDOW:], rewards[-2 * TREND_WINDOW : -TREND_WINDOW]
    out["reward_trend"] = (mean(recent) - mean(before)) if recent and before else None
    out["reward_spark"] = sparkline(rewards[-30:])
    evals = [
        (r["step"], k, float(v))
        for r in orch
        for k, v in r.items()
        if k.startswith("eval/") and "/avg@" in k and isinstance(v, (int, float))
    ]
    out["eval"] = {"step": evals[-1][0], **{k: v for s, k, v in evals if s == evals[-1][0]}} if evals else None
    first_eval = [(s, k, v) for s, k, v in evals if s == evals[0][0]] if evals else []
    out["eval_first"] = {"step": first_eval[0][0], **{k: v for _, k, v in first_eval}} if first_eval else None
    for key, name in (
        ("loss/mean", "loss"),
        ("val/loss", "val_loss"),
        ("mismatch_kl/mean", "mismatch_kl"),
        ("entropy/mean", "entropy"),
        ("perf/throughput", "tokens_per_s"),
    ):
        got = _last(trainer, key)
        out[name] = got[1] if got else None
    step_times = _series(trainer, "time/step")[-TREND_WINDOW:]
    out["s_per_step"] = mean(step_times) if step_times else None
    stamped = [r for r in trainer if "loss/mean" in r and isinstance(r.get("time"), (int, float))]
    out["last_step_at"] = stamped[-1]["time"] if stamped else None
    left = (max_steps - out["trainer_step"]) if max_steps and out["trainer_step"] is not None else None
    out["eta_s"] = left * out["s_per_step"] if left is not None and out["s_per_step"] and not ended else None
    return out


UNFILLED_KEYS = tuple((d.metric, str(d)) for d in Drop)  # (metrics key, why dropped)


def unfilled(rows: list[dict], written: Optional[int]) -> Optional[dict[str, Any]]:
    """The step the orchestrator gave up on or was stopped in (its `filter/unfilled` row,
    after the last step it wrote): {"step", "accepted", "judged", <why dropped>: count}."""
    row = next((r for r in reversed(rows) if r.get("filter/unfilled")), None)
    if row is None or (written is not None and row["step"] <= written):
        return None
    return {
        "step": row["step"],
        "accepted": row.get("filter/accepted_groups", 0),
        "judged": row.get("filter/judged_groups", 0),
        **{why: row[k] for k, why in UNFILLED_KEYS if row.get(k)},
    }


def _fmt(v: Optional[float], spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def format_vitals(v: dict[str, Any], kind: str) -> list[str]:
    """The lines `prime-hpc status` prints under the group table (an SFT run, `kind`
    "sft", has no orchestrator)."""
    total = v.get("max_steps")
    of = f"/{total}" if total else ""
    steps = f"step: trainer {v['trainer_step'] if v['trainer_step'] is not None else '-'}{of}"
    if kind != "sft":
        steps += f", orchestrator {v['orchestrator_step'] if v['orchestrator_step'] is not None else '-'}{of}"
    lines = [steps + (f", ETA {_duration(v['eta_s'])}" if v.get("eta_s") else "")]  # none once done
    if v.get("unfilled"):
        u = v["unfilled"]
        why = ", ".join(f"{k}: {n}" for k, n in u.items() if k not in ("step", "accepted", "judged"))
        lines.append(
            f"step {u['step']} not filled: {u['accepted']} group(s) accepted of {u['judged']} judged"
            + (f" ({why})" if why else "")
        )
    if v.get("reward") is not None:
        trend = v.get("reward_trend")
        arrow = "" if trend is None else f" ({'+' if trend >= 0 else ''}{trend:.3f} over the last {TREND_WINDOW} steps)"
        lines.append(f"reward: {v['reward']:.3f}{arrow}  {v.get('reward_spark', '')}")
    if v.get("eval"):
        scores = ", ".join(f"{k.split('/', 1)[1]} {x:.3f}" for k, x in v["eval"].items() if k != "step")
        first = v.get("eval_first")
        since = ""
        if first and first["step"] != v["eval"]["step"]:
            since = (
                " (step "
                + str(first["step"])
                + ": "
                + ", ".join(f"{x:.3f}" for k, x in first.items() if k != "step")
                + ")"
            )
        lines.append(f"eval at step {v['eval']['step']}: {scores}{since}")
    parts = [f"loss {_fmt(v.get('loss'), '.4f')}"]
    if v.get("val_loss") is not None:
        parts.append(f"val/loss {_fmt(v['val_loss'], '.4f')}")
    if v.get("mismatch_kl") is not None:
        parts.append(f"mismatch_kl {_fmt(v['mismatch_kl'], '.2e')}")
    parts += [
        f"entropy {_fmt(v.get('entropy'))}",
        f"{_fmt(v.get('s_per_step'), '.2f')} s/step",
        f"{_fmt(v.get('tokens_per_s'), '.0f')} tok/s",
    ]
    lines.append("trainer: " + ", ".join(parts))
    return lines


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
