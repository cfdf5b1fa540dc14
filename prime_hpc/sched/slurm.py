"""The SLURM backend (cluster=slurm): one (het) job per run, submitted through submitit
(`prime_hpc.sched.slurm_submit`, imported only to submit), asked about with squeue and
sacct directly and stopped with scancel; inside the job, `scontrol` requeues it and says
why it is being stopped. A het job's components are `<id>+<k>` (sacct never lists a bare
`<id>` for them); a plain job (one group, e.g. SFT) is `<id>`. Light: no submitit, no
config, no rendering outside `submit`."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

from prime_hpc.core.errors import LaunchError
from prime_hpc.rundir import RunDir
from prime_hpc.rundir.jobs import CANCELLED, COMPLETED, REQUEUED, job_groups, read_job
from prime_hpc.sched.base import Backend, JobSpec

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

# A requeued job may start again this long after the requeue. SLURM holds a requeued job
# for about two minutes (CredExpire) unless a start time set meanwhile is still ahead when
# the job has ended: its components end on SLURM's SIGTERM, within a few seconds.
REQUEUE_START_DELAY_S = 15


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


def stop_cause(info: dict[str, str], restart_count: int) -> str:
    """Why SLURM stops the job, from `scontrol show job` of it (`info`) and this attempt's
    SLURM_RESTART_COUNT: REQUEUED (its restart count went up: `scontrol requeue`, or a
    preemption that requeues at once), TIMEOUT, PREEMPTED (also while a preemption's grace
    time runs: SLURM has set PreemptTime, which it clears when the job starts again),
    else CANCELLED."""
    if int(info.get("Restarts", "0") or 0) > restart_count:
        return REQUEUED
    state, why = info.get("JobState", ""), info.get("Reason", "")
    if state == "TIMEOUT" or "TimeLimit" in why:
        return "TIMEOUT"
    if state == "PREEMPTED" or "Preempt" in why or info.get("PreemptTime", "None") not in ("None", "Unknown", ""):
        return "PREEMPTED"
    return CANCELLED


DOWN_STATES = ("down", "drain", "fail", "maint", "power", "unk")  # sinfo %T prefixes of a node lost to the job
LOST_FLAGS = ("drain", "fail", "not_responding")  # flags of the `+`-joined form that say the same


def job_nodes(job_id: str) -> list[str]:
    """Every node of the job, all its het components' (`scontrol show job`, expanded)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=30)
        lists = [
            f.split("=", 1)[1] for line in out.stdout.splitlines() for f in line.split() if f.startswith("NodeList=")
        ]
        names = subprocess.run(
            ["scontrol", "show", "hostnames", ",".join(x for x in lists if x and x != "(null)")],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return []
    return list(dict.fromkeys(names))


def node_failed(sinfo_state: str) -> bool:
    """A node's `sinfo -o %T` state says it is lost to its jobs: down, drained or failing
    (also "draining"/"drained"), or not responding (a trailing `*`); also in the `+`-joined
    form of `scontrol show node` and `sinfo -O StateComplete` (`MIXED+DRAIN`,
    `IDLE+NOT_RESPONDING`). A node that only works (`allocated`, `mixed`, `completing`), or
    is powering up or rebooting for the job (`allocated#`, `mixed@`), is not."""
    state = sinfo_state.strip().lower()
    base, *flags = state.split("+")
    return state.endswith("*") or base.startswith(DOWN_STATES) or any(f.startswith(LOST_FLAGS) for f in flags)


def failed_nodes(sinfo_out: str) -> dict[str, str]:
    """{node: state} of the nodes `node_failed` says are lost, from `sinfo -h -N -o "%N %T"`
    (a node listed once per partition; a line that is not `<node> <state>` is skipped)."""
    rows = [line.split() for line in sinfo_out.splitlines()]
    return {row[0]: row[1] for row in rows if len(row) == 2 and node_failed(row[1])}


LEFTOVER_WAIT_S = 60.0  # steps of an earlier attempt, killed, must be gone within this
OWN_STEPS = (".batch", ".extern", ".interactive")  # steps that are the job script's own, not a component's


def component_ids(scontrol_out: str) -> list[str]:
    """The job id of each component of a job (`scontrol show job -o`: one line each; a het
    job's components are `<id>`, `<id + 1>`, ...)."""
    fields = (dict(f.split("=", 1) for f in line.split() if "=" in f) for line in scontrol_out.splitlines())
    return [f["JobId"] for f in fields if f.get("JobId")]


def job_steps(job_ids: list[str]) -> list[str]:
    """The steps the job's components run (`squeue -s`: `<component id>.<step>`), but the
    job script's own (batch, extern)."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-s", "-j", ",".join(job_ids), "-o", "%i"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [s for s in out.split() if not s.endswith(OWN_STEPS)]


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job -o <id>` of the job (its first record: the het leader)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    first = out.splitlines()[0] if out.strip() else ""
    return dict(f.split("=", 1) for f in first.split() if "=" in f)


class Slurm(Backend):
    name = "slurm"
    # every step of the job gets the script's environment (which carries the job's key),
    # whatever the site's default; the head task runs under submitit's job environment
    job_env = {"SUBMITIT_EXECUTOR": "slurm", "SRUN_EXPORT_ENV": "ALL"}
    requeues = True
    extra_jobs = True

    def submit(self, job: JobSpec) -> tuple[str, dict[str, Any]]:
        """Submit the rendered `submit/<kind>.sbatch` running `job.task` on the head group;
        returns at once."""
        import shutil

        if shutil.which("sbatch") is None:
            raise LaunchError(
                "cluster.backend=slurm but no SLURM here (sbatch not found); use cluster=local "
                "or start the dev cluster: tools/dev-cluster start"
            )
        from prime_hpc.sched.slurm_submit import submit

        return submit(job), {}

    def submit_script(self, script: Path) -> str:
        """`sbatch --parsable` of a script that runs as it is (no submitit: no Python task
        to run). The job runs in the submitting environment, which carries the job's key,
        whatever the site's default: `--export=ALL` on the command line wins."""
        import shutil

        if shutil.which("sbatch") is None:
            raise LaunchError("no SLURM here (sbatch not found)")
        out = subprocess.run(
            ["sbatch", "--parsable", "--export=ALL", str(script)], capture_output=True, text=True, timeout=120
        )
        job_id = out.stdout.strip().split(";")[0]
        if out.returncode != 0 or not job_id.isdigit():
            detail = " ".join((out.stderr or out.stdout).split()) or f"exit code {out.returncode}"
            raise LaunchError(f"sbatch refused the job: {detail[-400:]}")
        return job_id

    def signal_script(self, job_id: str, signal_name: str) -> bool:
        """`scancel --batch --signal=<sig>`: the batch script only (its steps are not signalled)."""
        out = subprocess.run(
            ["scancel", "--batch", f"--signal={signal_name}", job_id], capture_output=True, text=True, timeout=60
        )
        return out.returncode == 0

    def plain_states(self, job_ids: list[str]) -> tuple[dict[str, str], str]:
        if not job_ids:
            return {}, ""
        states, note = live_states({j: 1 for j in job_ids})
        return states, (f"SLURM could not be asked ({note})" if note else "")

    def cancel(self, run: RunDir, job_id: str) -> None:
        out = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise LaunchError(f"scancel {job_id} failed: {out.stderr.strip()}")

    def group_states(self, run: RunDir, job_id: str) -> tuple[dict[str, str], Optional[str]]:
        """What squeue/sacct say of each component; what job.json recorded where SLURM
        no longer knows the job, or could not be asked (saying so)."""
        job = read_job(run)
        groups = job_groups(job)
        if job.get("state") == COMPLETED:  # written by the job itself as its last act
            return {g: COMPLETED for g in groups}, None
        try:
            states = component_states(job_id, groups)
        except SlurmUnreachable as e:
            recorded = job.get("state", "UNKNOWN")
            return {g: recorded for g in groups}, f"SLURM could not be asked ({e}); state as recorded in job.json"
        if len(states) < len(groups):  # not (or no longer) known to SLURM: what the job recorded
            return {g: states.get(g) or job.get("state", "UNKNOWN") for g in groups}, None
        return states, None

    def overall(self, states: dict[str, str]) -> str:
        return aggregate(list(states.values()))

    def states(self, records: dict[str, dict[str, Any]]) -> tuple[dict[str, str], str]:
        import shutil

        if not records or not shutil.which("squeue"):
            return {}, ""
        states, note = live_states({j: len(job_groups(rec)) for j, rec in records.items()})
        return states, (f"SLURM could not be asked ({note}); other states as recorded in each job.json" if note else "")

    def alive(self, run: RunDir, job_id: str) -> bool:
        return bool(squeue_components([job_id]))

    def batch_log(self, run: RunDir, job_id: str) -> Path:
        return run.slurm_batch_log(job_id)

    def requeue(self, job_id: str) -> str:
        """`scontrol requeue`, then let the job start again after REQUEUE_START_DELAY_S
        instead of SLURM's default hold of about two minutes. Not at once: a node refuses to
        launch a job whose credential it revoked in the same second ("Job credential
        revoked"), which fails the job instead of restarting it. SLURM signals every process
        of the job once it is requeued, this one too: it carries on. Returns an error
        message, or '' on success."""
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            return (out.stderr or out.stdout).strip() or f"scontrol exited with code {out.returncode}"
        self.requeued(job_id)
        return ""

    def requeued(self, job_id: str) -> None:
        """Start again after REQUEUE_START_DELAY_S, not SLURM's hold of about two minutes
        (also after SLURM's own requeue: `scontrol requeue`, a failed node of the job)."""
        try:
            subprocess.run(
                ["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{REQUEUE_START_DELAY_S}"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            pass

    def down_nodes(self, job_id: str) -> list[str]:
        nodes = job_nodes(job_id)
        if not nodes:
            return []
        try:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return sorted(failed_nodes(out))

    def stop_leftovers(self, job_id: str) -> tuple[list[str], list[str]]:
        """SLURM requeues only the leader's component of a het job whose leader's node (the
        head's: it runs the job script) failed, and starts the job script again while the
        other components' steps still run (22.05, measured): the previous attempt's trainer
        would go on beside the new one, into the same run. Called as a restarted attempt
        starts, before it starts any step: every step of the job but the script's own is
        an earlier attempt's, killed (SIGKILL) and waited for, at most LEFTOVER_WAIT_S.
        Returns (the steps found, those still there)."""
        try:
            out = subprocess.run(
                ["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return [], []
        ids = component_ids(out)
        steps = job_steps(ids) if ids else []
        if not steps:
            return [], []
        subprocess.run(["scancel", "--signal=KILL", *steps], capture_output=True, timeout=60)
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while (left := [s for s in job_steps(ids) if s in steps]) and time.monotonic() < deadline:
            time.sleep(1)
        return steps, left

    def stop_cause(self, run: RunDir, job_id: str) -> str:
        """SLURM's answer (`stop_cause` of `scontrol show job`), against this attempt's
        SLURM_RESTART_COUNT."""
        return stop_cause(job_fields(job_id), int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
