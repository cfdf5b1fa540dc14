"""The CLI's answer to a bad config: exit 2, one line, nothing written or submitted (the
rules themselves: tests/unit/test_config.py)."""

from __future__ import annotations

import pytest

from tests.conftest import cli


@pytest.mark.parametrize(
    "args",
    [
        ["trainer.optim.lrr=1"],
        ["orchestrator.batch_size=60"],
        ["+experiment=nope"],
        ["orchestrator.env.0.id=no_such_env_pkg"],
    ],
)
def test_cli_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args):
    out = tmp_path / "run"
    for command in (["submit"], ["submit", "--dry-run"], ["doctor"]):
        r = cli(*command, "+experiment=reverse_text", f"output_dir={out}", *args)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("prime-hpc: error: "), r.stderr
        assert "Traceback" not in r.stderr
        assert not out.exists()


def test_sweep_with_one_bad_point_submits_nothing(tmp_path):
    out = tmp_path / "sweep"
    r = cli("submit", "-m", "+experiment=reverse_text", f"output_dir={out}", "orchestrator.batch_size=64,60")
    assert r.returncode == 2 and "orchestrator.batch_size" in r.stderr
    assert not out.exists()
