"""The generic helpers of `prime_hpc.core`: the umask (`core.umask`), local paths
(`core.paths`), text tables (`core.text`) and the job's key (`core.jobenv.require_key`)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from prime_hpc.core import jobenv, umask
from prime_hpc.core.paths import is_local_path
from prime_hpc.core.text import columns


@pytest.fixture
def restored_umask():
    before = os.umask(0o022)
    os.umask(before)
    yield before
    os.umask(before)


# ----------------------------------------------------------------------------- umask
def test_current_umask_is_read_without_setting_it(restored_umask, monkeypatch):
    os.umask(0o027)
    calls = []
    real = os.umask
    monkeypatch.setattr(umask.os, "umask", lambda m: calls.append(m) or real(m))
    assert umask.current() == 0o027
    assert calls == []  # Linux tells it in /proc/self/status: never set to be read
    assert umask.file_mode() == 0o640 and umask.dir_mode() == 0o750


def test_current_umask_without_proc_sets_it_back(restored_umask, monkeypatch, tmp_path):
    monkeypatch.setattr(umask, "_STATUS", str(tmp_path / "no-such-status"))
    os.umask(0o077)
    assert umask.current() == 0o077
    assert umask.current() == 0o077  # and left as it was


def test_applied_umask_holds_for_the_block_and_is_restored_on_every_path(restored_umask, tmp_path):
    os.umask(0o022)
    with umask.applied("027"):
        assert umask.current() == 0o027
        (tmp_path / "f").write_text("x")
    assert umask.current() == 0o022
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640
    with pytest.raises(RuntimeError):
        with umask.applied(0o077):
            raise RuntimeError("boom")
    assert umask.current() == 0o022


def test_umask_reads_and_changes_from_many_threads_never_lose_the_value(restored_umask, monkeypatch, tmp_path):
    """The fallback read (set, then set back) and a change (`applied`, from one thread: the
    umask is the process's) never interleave, so the process ends with the value it had."""
    monkeypatch.setattr(umask, "_STATUS", str(tmp_path / "no-such-status"))  # the fallback everywhere
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    os.umask(0o027)
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            umask.current()

    def changer():
        for _ in range(5000):
            with umask.applied("077"):
                pass

    try:
        readers = [threading.Thread(target=reader) for _ in range(3)]
        changers = [threading.Thread(target=changer)]
        for t in readers + changers:
            t.start()
        for t in changers:
            t.join()
        stop.set()
        for t in readers:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert umask.current() == 0o027


# ----------------------------------------------------------------------------- local paths
@pytest.mark.parametrize("name", [".", "..", "./m", "../m", "/abs/m", "~", "~/m", "~user/m"])
def test_names_written_as_paths_are_local(name):
    assert is_local_path(name)


@pytest.mark.parametrize("name", ["Qwen/Qwen3-0.6B", "tiny", "reverse_text", "pkg.mod:fn", "", ".hidden", "..x"])
def test_hub_ids_modules_and_bare_names_are_not_local_paths(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)  # on the text alone, not what exists here
    assert not is_local_path(name)


# ----------------------------------------------------------------------------- tables
def test_columns_pad_all_but_the_last_column_and_strip_line_ends():
    rows = [("GROUP", "STATE", "DETAIL"), ("trainer", "RUNNING", "a long detail"), ("inference", "", "")]
    assert columns(rows) == [
        "GROUP      STATE    DETAIL",
        "trainer    RUNNING  a long detail",
        "inference",
    ]
    assert columns(rows, indent="  ")[1] == "  trainer    RUNNING  a long detail"
    assert columns(rows, sep=" | ")[0] == "GROUP     | STATE   | DETAIL"


def test_columns_of_nothing_and_of_ragged_rows():
    assert columns([]) == []
    assert columns([("a",), ("bb", "c")]) == ["a", "bb  c"]
    assert columns([("x", 1)]) == ["x  1"]  # cells are shown as text


def test_doctor_table_reads_as_before():
    from prime_hpc.job.preflight import format_table

    check = {"name": "gpu", "ok": False, "detail": "no GPU"}
    summary = {
        "groups": {
            "trainer": [{"rank": 0, "host": "n1", "ok": False, "checks": [check]}],
            "orchestrator": [{"rank": 0, "host": None, "ok": True, "checks": [{"name": "disk", "ok": True}]}],
        }
    }
    assert format_table(summary).splitlines() == [
        "GROUP         RANK  RESULT  HOST  DETAIL",
        "orchestrator  0     PASS    -     disk",
        "trainer       0     FAIL    n1    gpu: no GPU",
    ]


# ----------------------------------------------------------------------------- the job's key
def test_require_key_returns_the_key_or_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv(jobenv.API_KEY_VAR, "s3cret")
    assert jobenv.require_key("prime-hpc router", "the router") == "s3cret"
    assert capsys.readouterr().err == ""
    for unset in (lambda: monkeypatch.delenv(jobenv.API_KEY_VAR), lambda: monkeypatch.setenv(jobenv.API_KEY_VAR, "")):
        unset()
        assert jobenv.require_key("prime-hpc inference", "a server") is None
        assert capsys.readouterr().err == (
            "prime-hpc inference: INFERENCE_SERVER_API_KEY is not set: a server never serves without the job's "
            "key (the job's environment must carry it)\n"
        )
