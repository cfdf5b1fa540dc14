"""`prime-hpc completion bash`: the generated script, run by a real bash, completes
commands, options, config groups and options, and schema keys; generating it imports
neither Hydra nor torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, cli

CASES = [
    ("prime-hpc su", ["submit"]),
    ("prime-hpc submit --be", ["--bench"]),
    ("prime-hpc submit trainer.optim.l", ["trainer.optim.lr="]),
    ("prime-hpc submit cluster=", ["dev", "local", "slurm"]),  # bash completes after the '='
    ("prime-hpc submit +experiment=reverse_text +experiment=reverse_text_s", ["reverse_text_sft"]),
    ("prime-hpc resume JOB ckpt.st", ["ckpt.step="]),
    ("prime-hpc submit bench.m", ["bench.mode="]),
    ("prime-hpc status --j", ["--json"]),
    ("prime-hpc status trainer.optim.l", []),  # status takes no overrides
    ("prime-hpc completion b", ["bash"]),
    ("prime-hpc config ", ["--help", "-h", "export"]),
    ("prime-hpc config e", ["export"]),
    ("prime-hpc config export JOB --o", ["--out"]),
]


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    r = cli("completion", "bash")
    assert r.returncode == 0, r.stderr
    path = tmp_path_factory.mktemp("completion") / "prime-hpc.bash"
    path.write_text(r.stdout)
    return path


@pytest.mark.parametrize("line, expected", CASES, ids=[c[0] for c in CASES])
def test_bash_completes(script, line, expected):
    code = (
        f'source "{script}"; COMP_LINE="$1"; COMP_POINT=${{#COMP_LINE}}; _prime_hpc; printf "%s\\n" "${{COMPREPLY[@]}}"'
    )
    r = subprocess.run(["bash", "-c", code, "bash", line], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert sorted(w for w in r.stdout.splitlines() if w) == expected


def test_generating_the_script_imports_no_hydra_or_torch():
    code = (
        "import sys, contextlib, io\nfrom prime_hpc.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n    main(['completion', 'bash'])\n"
        "print(sorted(m for m in ('hydra', 'torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr


def test_unknown_shell_is_refused():
    r = cli("completion", "fish")
    assert r.returncode == 2 and "invalid choice" in r.stderr
