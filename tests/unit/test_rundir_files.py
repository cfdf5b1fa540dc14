"""The readers every component shares (`prime_hpc.rundir.files`): the end of a file
(`read_tail`, `tail_lines`, `tail`), JSON-lines rows with a step (`jsonl_row`,
`read_rows`), and the deletion of a marked directory (`remove_marked`), including what a
failure halfway leaves."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prime_hpc.rundir import (
    CHECKPOINT_PARTS,
    STABLE,
    MarkerError,
    RunDir,
    is_stable,
    jsonl_row,
    last_line,
    mark_stable,
    read_rows,
    read_tail,
    remove_marked,
    tail,
    tail_lines,
)
from tests.conftest import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


# ----------------------------------------------------------------------------- ends of files
def test_read_tail_gives_the_window_and_where_it_starts(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"0123456789")
    assert read_tail(path, 4) == (6, b"6789")
    assert read_tail(path, 100) == (0, b"0123456789")
    assert read_tail(tmp_path / "missing", 4) == (0, b"")
    assert read_tail(tmp_path, 4) == (0, b"")  # a directory cannot be read either


def test_tail_lines_leave_out_the_line_the_window_cuts_unless_asked(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"first line\nsecond\nthird\nunterminated")
    window = len(b"ond\nthird\nunterminated")
    assert tail_lines(path, window) == ["third", "unterminated"]
    assert tail_lines(path, window, keep_cut=True) == ["ond", "third", "unterminated"]
    assert tail_lines(path, 1000) == ["first line", "second", "third", "unterminated"]  # the whole file: no cut
    assert tail_lines(tmp_path / "missing", 10) == []


def test_tail_lines_replace_undecodable_bytes(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"ok\n\xff\xfe broken\n")
    assert tail_lines(path, 100) == ["ok", "\ufffd\ufffd broken"]


def test_tail_keeps_the_last_lines_of_a_log(tmp_path):
    path = tmp_path / "log"
    path.write_text("".join(f"line {i}\n" for i in range(100)))
    assert tail(path, 3) == "line 97\nline 98\nline 99"
    assert tail(tmp_path / "missing") == ""
    path.write_text("x" * 100_000)  # one line longer than the window: its end, not nothing
    assert tail(path) == "x" * 65536


def test_the_watchdogs_last_line_is_the_last_non_blank_one_of_the_window(tmp_path):
    path = tmp_path / "log"
    path.write_text("step 1\n  step 2  \n\n   \n")
    assert last_line(path) == "step 2"
    path.write_text("y" * 20_000)  # a progress bar that never ended its line
    assert last_line(path) == "y" * 300
    assert last_line(tmp_path / "missing") == ""


# ----------------------------------------------------------------------------- JSON lines
def test_jsonl_row_takes_objects_with_an_integer_step():
    assert jsonl_row('{"step": 3, "a": 1}') == {"step": 3, "a": 1}
    assert jsonl_row(b'{"step": 0}') == {"step": 0}
    for line in ('{"a": 2}', '{"step": "3"}', '{"step": true}', '{"step": 1.5}', "[1, 2]", '{"st', "", "NaN"):
        assert jsonl_row(line) is None, line
    assert jsonl_row('{"a": 2}', with_step=False) == {"a": 2}
    assert jsonl_row("[1, 2]", with_step=False) is None


def test_read_rows_keeps_only_rows_with_an_integer_step(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"step": 1, "a": 1}\n[1, 2]\n{"a": 2}\n{"step": "3"}\n{"step": true}\n\n{"step": 2, "a": NaN}\n{"st'
    )
    assert [r["step"] for r in read_rows(path)] == [1, 2]
    assert read_rows(tmp_path / "missing") == [] and read_rows(tmp_path / "missing", 100) == []


def test_read_rows_of_a_window_never_parse_the_cut_line(tmp_path):
    """A cut line's end may itself be valid JSON (here `{"step": 9}`): it is not a row."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"junk": 1}{"step": 9}\n{"step": 2}\n')
    assert [r["step"] for r in read_rows(path)] == [1, 2]
    assert [r["step"] for r in read_rows(path, len('{"step": 9}\n{"step": 2}\n'))] == [2]
    rows = [{"step": s, "loss/mean": 0.5} for s in range(1000)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recent = read_rows(path, 4096)
    assert recent == rows[-len(recent) :] and 50 < len(recent) < 4096 // 20


# ----------------------------------------------------------------------------- deleting marked directories
def _checkpoint_step(run: RunDir, step: int) -> list[Path]:
    """A complete RL checkpoint step: both parts with data and a marker."""
    files = []
    for part in ("trainer", "orchestrator"):
        d = run.checkpoint_part(step, part)
        d.mkdir(parents=True)
        for name in ("state.json", "__0_0.distcp"):
            (d / name).write_text(name)
            files.append(d / name)
        mark_stable(d)
    return files


def test_remove_marked_deletes_a_marked_tree(tmp_path):
    run = RunDir(tmp_path)
    _checkpoint_step(run, 3)
    remove_marked(run.checkpoint_step(3))
    assert not run.checkpoint_step(3).exists() and run.checkpoints_dir.is_dir()
    remove_marked(run.checkpoint_step(3))  # gone already: no error
    remove_marked(tmp_path / "never-was")


def test_remove_marked_can_keep_the_directory_itself(tmp_path):
    run = RunDir(tmp_path / "run")
    _checkpoint_step(run, 1)
    (run.root / "job.json").write_text("{}")
    (run.root / "link").symlink_to(tmp_path)  # a link is removed, never followed
    remove_marked(run.root, keep_root=True, check=True)
    assert run.root.is_dir() and list(run.root.iterdir()) == [] and tmp_path.is_dir()


def test_remove_marked_never_reaches_through_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    mark_stable(elsewhere)
    link = tmp_path / "weights" / "step_1"
    link.parent.mkdir()
    link.symlink_to(elsewhere)
    remove_marked(link)
    with pytest.raises(OSError, match="a symbolic link"):
        remove_marked(link, check=True)
    assert link.is_symlink() and is_stable(elsewhere)


def test_a_marker_that_cannot_be_removed_refuses_the_deletion(tmp_path):
    """Nothing but markers is deleted when one of them cannot go; the one line says which."""
    run = RunDir(tmp_path)
    files = _checkpoint_step(run, 2)
    stuck = run.checkpoint_part(2, "orchestrator") / STABLE
    stuck.unlink()
    (stuck / "x").mkdir(parents=True)  # a marker unlink() cannot remove (as root too)
    with pytest.raises(MarkerError) as e:
        remove_marked(run.checkpoint_step(2))
    assert len(str(e.value).splitlines()) == 1 and str(stuck) in str(e.value), e.value
    assert all(f.exists() for f in files)
    assert run.complete_checkpoint_steps() == []  # never marked complete again: the trainer's marker went first


def test_a_deletion_that_fails_halfway_leaves_an_unmarked_leftover(tmp_path, monkeypatch):
    """Once the markers are gone, a file that cannot be deleted stays, unmarked: a reader
    never takes the torn directory for complete, and the next deletion takes it."""
    run = RunDir(tmp_path)
    _checkpoint_step(run, 4)
    _checkpoint_step(run, 5)
    unlink = os.unlink

    def refuse_shards(name, *args, **kwargs):
        if str(name).endswith(".distcp"):
            raise OSError(errno.EIO, "Input/output error", name)
        return unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse_shards)
    remove_marked(run.checkpoint_step(4))  # a best-effort deletion says nothing ...
    with pytest.raises(OSError, match="Input/output error"):
        remove_marked(run.checkpoint_step(5), check=True)  # ... a checked one raises the first error
    for step in (4, 5):
        left = sorted(p.name for p in run.checkpoint_step(step).rglob("*") if p.is_file())
        assert left == ["__0_0.distcp", "__0_0.distcp"], left  # only what could not go
        assert not any(is_stable(run.checkpoint_part(step, part)) for part in CHECKPOINT_PARTS)
    assert run.complete_checkpoint_steps() == [] and run.latest_checkpoint_step() is None
    monkeypatch.setattr(os, "unlink", unlink)
    remove_marked(run.checkpoint_step(4), check=True)
    assert not run.checkpoint_step(4).exists()


KILLED_DELETER = textwrap.dedent(
    """
    import sys
    from prime_hpc.rundir import remove_marked
    print("ready", flush=True)
    sys.stdin.readline()
    remove_marked(sys.argv[1])
    """
)


def test_a_deletion_killed_at_any_moment_never_leaves_a_marked_torn_directory(tmp_path):
    """SIGKILL the deleter at random moments: the directory is whole and marked, or
    unmarked (torn or gone), never marked with files missing."""
    files = 2000
    outcomes = set()
    rng = random.Random(7)
    for trial in range(40):
        d = tmp_path / f"weights_{trial}" / "step_1"
        d.mkdir(parents=True)
        for i in range(files):
            (d / f"shard_{i}").write_bytes(b"x")
        mark_stable(d)
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_DELETER, str(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=ENV
        )
        assert proc.stdout.readline() == b"ready\n"
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        time.sleep(rng.uniform(0, 0.03))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left = len(os.listdir(d)) if d.exists() else 0
        if is_stable(d):
            assert left == files + 1, f"trial {trial}: marked with {left - 1} of {files} files"
            outcomes.add("whole")
        else:
            outcomes.add("torn" if left else "gone")
        if "torn" in outcomes and trial >= 3:
            break
    assert "torn" in outcomes, outcomes  # the kill did land mid-deletion


def test_wipe_empties_the_run_directory_markers_first(tmp_path):
    run = RunDir(tmp_path / "run")
    files = _checkpoint_step(run, 1)
    run.doctor_run.root.mkdir(parents=True)
    run.doctor_run.doctor_marker.write_text("doctor's")
    (run.root / "job.json").write_text("{}")
    stuck = run.weights_step(1) / STABLE
    (stuck / "x").mkdir(parents=True)
    with pytest.raises(MarkerError, match="the marker cannot be removed"):
        run.wipe()
    assert all(f.exists() for f in files) and (run.root / "job.json").exists()
    assert not run.doctor_run.doctor_marker.exists()  # every other marker went first
    assert run.complete_checkpoint_steps() == []
    stuck.rename(run.weights_step(1) / "not-a-marker")
    run.wipe()
    assert run.root.is_dir() and list(run.root.iterdir()) == []
