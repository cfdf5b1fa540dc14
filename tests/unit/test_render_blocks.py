"""The blocks the two job scripts share (`sbatch_templates/_blocks.sh.j2`: preamble, the
attempt's start, the file rendezvous, torchrun, the watchdog) are written once, and the
local script is pinned like the batch script (tests/golden/*.local.sh; the batch scripts
are pinned by test_render.py)."""

from __future__ import annotations

import subprocess

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher.plan import make_plan
from prime_hpc.launcher.render import TEMPLATES, render_local
from tests.conftest import REPO
from tests.unit.test_render import GOLDEN_OVERRIDES, golden_plan, golden_sft_plan

GOLDEN_DIR = REPO / "tests" / "golden"
JOB_ID = "local-7"


def golden_doctor_plan():
    """The preflight of the golden RL run: orchestrator and trainer groups, no watchdog."""
    return make_plan(compose(GOLDEN_OVERRIDES), "doctor", python="/opt/venv/bin/python", cores=[0, 1])


LOCAL_GOLDENS = [
    (golden_plan, GOLDEN_DIR / "rl.local.sh"),
    (golden_sft_plan, GOLDEN_DIR / "sft.local.sh"),
    (golden_doctor_plan, GOLDEN_DIR / "rl-doctor.local.sh"),
]


@pytest.mark.parametrize("plan_fn, golden", LOCAL_GOLDENS)
def test_local_script_matches_golden_file(plan_fn, golden):
    text = render_local(plan_fn(), JOB_ID)
    assert text == golden.read_text(), (
        f"the rendering of {golden.name} changed; review the difference, then write the goldens anew with "
        "`python -m tests.unit.test_render_blocks`"
    )
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


@pytest.mark.parametrize(
    "line",
    [
        "set +e -uo pipefail",
        "LOGS=$(attempt start)",
        "INFERENCE_SERVER_API_KEY did not reach the job's environment",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "-m torch.distributed.run",
        "--redirects=3 --tee=3",
        "# the stall watchdog",
        "PIDS[watchdog]=$!",
    ],
)
def test_a_shared_block_is_written_once(line):
    """Each line of a shared block stands in one template only, `_blocks.sh.j2`."""
    holding = sorted(p.name for p in TEMPLATES.glob("*.j2") if line in p.read_text())
    assert holding == ["_blocks.sh.j2"], holding


def test_both_scripts_render_the_shared_blocks_alike():
    """The preamble, the attempt's start and the watchdog read the same in both scripts."""
    from prime_hpc.launcher.render import render_sbatch

    plan = golden_plan()
    sbatch, local = render_sbatch(plan), render_local(plan, JOB_ID)
    start = sbatch.index("set +e -uo pipefail")
    preamble = sbatch[start : sbatch.index("\n\n", start)]
    assert preamble in local and "export PRIME_HPC_CACHE=/shared/cache" in preamble
    start = sbatch.index("LOGS=$(attempt start)")
    attempt = sbatch[start : sbatch.index("\n}\n", start) + 2]
    assert attempt in local and attempt.count("\n") == 7
    for script, prefix, job_id in ((sbatch, "", '"$SLURM_JOB_ID"'), (local, "setsid ", JOB_ID)):
        assert f"{prefix}/opt/venv/bin/python -u -m prime_hpc.job.watchdog" in script
        assert f"--job-id {job_id} --supervisor-pid $$" in script
        assert f"--rdzv-id={job_id} \\\n" in script


if __name__ == "__main__":  # write the goldens from today's rendering (after reviewing the change)
    for plan_fn, golden in LOCAL_GOLDENS:
        golden.write_text(render_local(plan_fn(), JOB_ID))
        print(f"wrote {golden}")
