"""Rendering of the het-job script: pinned by a golden file, and safe for shell-hostile
run names and paths (the values reach the shell and sbatch exactly as given)."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from prime_hpc.config import compose
from prime_hpc.launcher.plan import make_plan, slurm_job_name
from prime_hpc.launcher.render import render_local, render_sbatch, sbatch_quote
from tests.conftest import HOSTILE, REPO, hydra_quote

GOLDEN = REPO / "tests" / "golden" / "rl.sbatch"
GOLDEN_OVERRIDES = [
    "+experiment=reverse_text",
    "cluster=dev",
    "output_dir=/shared/runs/reverse_text",
    "cluster.account=proj",
    "cluster.qos=high",
    "cluster.constraint=ib",
    "cluster.exclude=node9",
    "cluster.inference.nodes=2",
    "cluster.trainer.nodes=2",
    "cluster.orchestrator.mem_gb=4",
    "cluster.inference.mem_gb=16",
    "cluster.trainer.mem_gb=8",
    "cluster.sbatch_extra=[\"--mail-type=END\"]",
    "cluster.env_setup=[\"module load cuda\"]",
]


def golden_plan():
    plan = make_plan(compose(GOLDEN_OVERRIDES), python="/opt/venv/bin/python")
    plan.head_argv = [plan.python, "-u", "-m", "submitit.core._submit", str(plan.run.submitit_dir)]
    return plan


def test_sbatch_matches_golden_file():
    text = render_sbatch(golden_plan())
    if os.environ.get("PRIME_HPC_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "rendering changed; review and rerun with PRIME_HPC_UPDATE_GOLDEN=1"


def test_golden_script_is_a_three_group_het_job():
    text = GOLDEN.read_text()
    assert text.count("#SBATCH hetjob") == 2
    # rendezvous probe, inference servers, router (first inference node), trainer, head
    assert re.findall(r"srun --het-group=(\d)", text) == ["2", "1", "1", "2", "0"]
    assert "--overlap" in text and "router_0.log" in text
    assert "--rdzv-backend=c10d" in text and "--redirects=3 --tee=3" in text
    assert '--log-dir="$LOGS/trainer/torchrun"' in text
    assert "#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=1\n#SBATCH --mem=8192M" in text
    assert text.count("#SBATCH --mem=") == 3  # one per group: SLURM would copy one group's to the next
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_hostile_values_survive_quoting(tmp_path):
    out = tmp_path / HOSTILE
    cfg = compose(["+experiment=reverse_text", "cluster=dev", f"output_dir={hydra_quote(str(out))}",
                   f"name={hydra_quote(HOSTILE)}"])
    plan = make_plan(cfg, python="/opt/venv/bin/python")
    plan.head_argv = [plan.python, "-m", "x", str(plan.run.submitit_dir)]
    for text in (render_sbatch(plan), render_local(plan, "local-1")):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)
        # the exported values, evaluated by bash, are exactly the originals
        exports = "\n".join(ln for ln in text.splitlines() if ln.startswith("export "))
        env = subprocess.run(["bash", "-c", exports + '\nprintf %s "$PRIME_HPC_OUTPUT_DIR"'], capture_output=True,
                             text=True, cwd=tmp_path, check=True)
        assert env.stdout == str(out)
    assert not (tmp_path / "PWNED").exists()
    assert re.fullmatch(r"[A-Za-z0-9._-]+", slurm_job_name(HOSTILE))


@pytest.mark.parametrize("value", ["plain", "a b", "it's", 'say "hi"', "back\\slash", "$(x) `y`; z"])
def test_sbatch_quote_roundtrip(value):
    """What sbatch's #SBATCH parser makes of the quoted value (double quotes group,
    backslash escapes): reproduced here to pin the rule the dev-cluster test checks live."""
    quoted = sbatch_quote(value)
    out, esc, inq = [], False, False
    for ch in quoted:
        if esc:
            out.append(ch)
            esc = False
        elif ch == "\\":
            esc = True
        elif ch == '"':
            inq = not inq
        else:
            assert inq or not ch.isspace()
            out.append(ch)
    assert "".join(out) == value
