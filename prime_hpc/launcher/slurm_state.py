"""What SLURM says of a run's jobs, asked with squeue and sacct directly: light enough
for `status`, `list`, `tail` and `cancel` (no submitit, no config, no rendering)."""

from __future__ import annotations

import subprocess
from typing import Optional

ACTIVE = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "COMPLETING",
    "CONFIGURING",
    "RESIZING",
    "SUSPENDED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
}
FAILED_FIRST = ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "BOOT_FAIL", "DEADLINE", "PREEMPTED", "CANCELLED")


def aggregate(states: list[str]) -> str:
    """One state for a het job from its components' states. COMPLETING (ended, SLURM still
    cleaning up, e.g. just after a cancel) only when no component is running any more."""
    states = [s.split()[0] if s else "UNKNOWN" for s in states]  # "CANCELLED by 0" -> CANCELLED
    if not states or all(s == "UNKNOWN" for s in states):
        return "UNKNOWN"
    if all(s == "COMPLETED" for s in states):
        return "COMPLETED"
    if any(s in ACTIVE and s not in ("PENDING", "COMPLETING") for s in states):
        return "RUNNING"
    if "COMPLETING" in states:
        return "COMPLETING"
    if all(s == "PENDING" for s in states):
        return "PENDING"
    for s in FAILED_FIRST:
        if s in states:
            return s
    return states[0]


class SlurmUnreachable(RuntimeError):
    """squeue/sacct could not answer (controller or accounting down); says which."""


def _ask(cmd: list[str]) -> str:
    """stdout of a SLURM query; `SlurmUnreachable` when it could not be answered (an
    unknown job id is an answer: no lines)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmUnreachable(f"{cmd[0]}: {e}") from None
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        raise SlurmUnreachable(f"{cmd[0]}: {_last_error(cmd[0], out.stderr) or f'exit code {out.returncode}'}")
    return out.stdout


def _last_error(tool: str, stderr: str) -> str:
    """The last line of a SLURM tool's complaint without its "<tool>: error: " prefix
    (sacct, say, writes several lines; the last one names the cause)."""
    lines = [" ".join(line.split()) for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    for prefix in (f"{tool}: ", "error: "):
        if last.startswith(prefix):
            last = last[len(prefix) :]
    return last[:200]


def _components(cmd: list[str], strict: bool = False) -> dict[str, dict[int, str]]:
    """{leader id: {het group index: state}} from squeue/sacct lines "<id>+<k>|<state>"
    (a plain job's line "<id>|<state>" is its group 0). With `strict`, an unanswered
    query raises `SlurmUnreachable`; otherwise it counts as no lines."""
    try:
        out = _ask(cmd)
    except SlurmUnreachable:
        if strict:
            raise
        return {}
    found: dict[str, dict[int, str]] = {}
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        leader, plus, k = jid.partition("+")
        if plus and k.isdigit():
            found.setdefault(leader, {})[int(k)] = state
        elif not plus and leader.isdigit():
            found.setdefault(leader, {})[0] = state
    return found


def squeue_components(job_ids: list[str], finished_too: bool = False) -> dict[str, dict[int, str]]:
    """Component states the controller knows (queued and running; with `finished_too`,
    also jobs that ended in the last MinJobAge seconds)."""
    cmd = ["squeue", "-h", "-o", "%i|%T", "-j", ",".join(job_ids)] + (["-t", "all"] if finished_too else [])
    return _components(cmd)


def component_states(job_id: str, groups: list[str]) -> dict[str, str]:
    """{group name: state} of one job: squeue while the controller knows it, else sacct.
    Raises `SlurmUnreachable` when neither can answer."""
    found = _components(["squeue", "-h", "-o", "%i|%T", "-t", "all", "-j", job_id], strict=True).get(job_id)
    if not found:
        found = _components(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", job_id], strict=True).get(job_id)
    return {groups[k]: st for k, st in (found or {}).items() if k < len(groups)}


def live_states(groups: dict[str, int]) -> tuple[dict[str, str], Optional[str]]:
    """({job id: aggregated state}, note) for {job id: number of groups}: squeue for what
    the controller still knows, sacct for the rest, and only once it lists every component
    (early on it shows one row). The note says what could not be asked (those jobs are
    left out)."""
    job_ids = list(groups)
    note = None
    try:
        found = _components(["squeue", "-h", "-o", "%i|%T", "-t", "all", "-j", ",".join(job_ids)], strict=True)
    except SlurmUnreachable as e:
        found, note = {}, str(e)
    rest = [j for j in job_ids if j not in found]
    if rest:
        try:
            found.update(
                _components(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(rest)], strict=True)
            )
        except SlurmUnreachable as e:
            note = "; ".join(filter(None, [note, str(e)]))
    return {j: aggregate(list(s.values())) for j, s in found.items() if j in groups and len(s) >= groups[j]}, note
