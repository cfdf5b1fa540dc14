"""Checks the single-machine SLURM dev cluster (tools/dev-cluster) really works.

The cluster must already be running (CI starts it before pytest): these tests do not start
it, and they FAIL (not skip) when it is missing, because a silently skipped SLURM test
would hide that nothing SLURM-related was tested.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
DEV_CLUSTER = REPO / "tools" / "dev-cluster"
HINT = "start the dev cluster first: `tools/dev-cluster start` (as root)"
# Generous bound on how long a tiny het job may take from submission to a COMPLETED record
# in sacct; with bf_interval=1 it normally takes a few seconds. Not a timing assertion.
JOB_DEADLINE_S = 120
# Responding (no '*' suffix), not drained/down. Others may be running jobs on the shared dev
# cluster, so allocated nodes and "plnd" (idle, held for a backfill-planned job) count too.
USABLE_NODE_STATES = {"idle", "mix", "alloc", "plnd"}
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "REVOKED",
}


def run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def cluster() -> None:
    """Fail with a clear hint unless SLURM is installed and the controller answers."""
    missing = [c for c in ("sinfo", "sbatch", "sacct", "scancel") if shutil.which(c) is None]
    if missing:
        pytest.fail(f"SLURM commands not on PATH ({', '.join(missing)}); {HINT}")
    try:
        r = run(["sinfo", "-h", "-o", "%P"], timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"sinfo timed out: the SLURM controller is not answering; {HINT}")
    if r.returncode != 0:
        pytest.fail(f"sinfo failed (cluster down?): {r.stderr.strip()}; {HINT}")


def test_status_reports_up(cluster: None) -> None:
    r = run([str(DEV_CLUSTER), "status"], timeout=60)
    assert r.returncode == 0, f"dev-cluster status exited {r.returncode}; {HINT}\n{r.stdout}{r.stderr}"
    assert "state directory:" in r.stdout
    assert "slurmctld" in r.stdout and "up" in r.stdout


def test_at_least_three_usable_nodes(cluster: None) -> None:
    r = run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
    assert r.returncode == 0, r.stderr
    states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
    usable = sorted(n for n, s in states.items() if s in USABLE_NODE_STATES)
    assert len(usable) >= 3, f"need >= 3 idle/mixed nodes, sinfo says {states}; {HINT}"


HET_SCRIPT = """\
#!/bin/bash
#SBATCH --job-name=prime-hpc-dev-cluster-test
#SBATCH --output={out}
#SBATCH --time=5
#SBATCH --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
set -euo pipefail
echo "GROUP0=$SLURM_JOB_NODELIST_HET_GROUP_0"
echo "GROUP1=$SLURM_JOB_NODELIST_HET_GROUP_1"
echo "GROUP2=$SLURM_JOB_NODELIST_HET_GROUP_2"
# All "nodes" share this host, so `hostname` is the same everywhere; SLURMD_NODENAME is not.
srun --het-group=1 hostname
srun --het-group=2 hostname
srun --het-group=1 bash -c 'echo "STEP1=$SLURMD_NODENAME"'
srun --het-group=2 bash -c 'echo "STEP2=$SLURMD_NODENAME"'
"""


def _component_states(job_id: str) -> dict[str, str]:
    """sacct states of the het components, e.g. {'42+0': 'COMPLETED', '42+1': ...}."""
    r = run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,State"], timeout=30)
    if r.returncode != 0:
        return {}
    rows = (line.split("|") for line in r.stdout.splitlines() if "|" in line)
    # State may read "CANCELLED by 0"; keep the first word.
    return {jid: state.split()[0] for jid, state in rows if re.fullmatch(rf"{job_id}\+\d+", jid)}


def test_three_group_het_job_completes(cluster: None, tmp_path: Path) -> None:
    out = tmp_path / "het-%j.out"
    script = tmp_path / "het.sbatch"
    script.write_text(HET_SCRIPT.format(out=out))
    r = run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(script)], timeout=60)
    assert r.returncode == 0, f"sbatch failed: {r.stderr}"
    job_id = r.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"unexpected sbatch --parsable output {r.stdout!r}"

    finished = False
    try:
        deadline = time.monotonic() + JOB_DEADLINE_S
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = _component_states(job_id)
            if len(states) == 3 and set(states.values()) <= TERMINAL_STATES:
                finished = True
                break
            time.sleep(1)
        squeue = run(["squeue", "-j", job_id, "-o", "%i %T %R"], timeout=30).stdout
        assert finished, f"het job {job_id} not finished after {JOB_DEADLINE_S}s: sacct={states} squeue={squeue}"
        expected = {f"{job_id}+{i}": "COMPLETED" for i in range(3)}
        log = Path(str(out).replace("%j", job_id))
        output = log.read_text() if log.exists() else "<no output file>"
        assert states == expected, f"sacct states {states}; job output:\n{output}"

        values = dict(re.findall(r"^(GROUP\d|STEP\d)=(\S+)$", output, flags=re.M))
        groups = [values.get(f"GROUP{i}") for i in range(3)]
        assert all(groups), f"missing SLURM_JOB_NODELIST_HET_GROUP_* in output:\n{output}"
        assert len(set(groups)) == 3, f"het groups not on distinct nodes: {groups}"
        # Each srun --het-group=N step ran on that group's node.
        assert values.get("STEP1") == groups[1] and values.get("STEP2") == groups[2], output
    finally:
        if not finished:
            run(["scancel", job_id], timeout=30)
