"""Temporary directories of ours: a socket's directory stays short enough to bind under a long
TMPDIR, and what a killed process left (named with its pid) is swept by the next start."""

from __future__ import annotations

import os
import tempfile

import pytest

from autotuner.launch import stopping


@pytest.fixture
def long_tmpdir(tmp_path, monkeypatch):
    directory = tmp_path / ("t" * max(1, 90 - len(str(tmp_path))))
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


def test_a_directory_for_sockets_leaves_a_long_tmpdir_for_a_short_one(long_tmpdir):
    plain = stopping.make_temporary_dir("plain")
    for_sockets = stopping.make_temporary_dir("mp", holds_sockets=True)
    try:
        assert os.path.dirname(plain) == str(long_tmpdir)
        assert os.path.dirname(for_sockets) in stopping.SHORT_TEMP_ROOTS
        assert len(os.path.join(for_sockets, "listener-abcdefgh")) <= stopping.SOCKET_PATH_MAX
    finally:
        stopping.remove_temporary_dir(plain)
        stopping.remove_temporary_dir(for_sockets)
    assert not os.path.exists(for_sockets)


def test_a_short_tmpdir_keeps_the_sockets_directory(monkeypatch):
    short = tempfile.mkdtemp(prefix="s", dir="/tmp")
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        path = stopping.make_temporary_dir("mp", holds_sockets=True)
        stopping.remove_temporary_dir(path)
        assert os.path.dirname(path) == short
    finally:
        os.rmdir(short)


def test_the_sweep_removes_what_a_dead_process_left_in_tmpdir_and_in_the_short_roots(long_tmpdir, monkeypatch,
                                                                                     tmp_path):
    short_root = tmp_path / "short"
    short_root.mkdir()
    monkeypatch.setattr(stopping, "SHORT_TEMP_ROOTS", (str(short_root),))
    gone_pid = 2**22 + 12345  # above the kernel's pid_max default: no such process
    dead = [long_tmpdir / f"autotuner-mp-{gone_pid}-abc", short_root / f"autotuner-rank-{gone_pid}-def"]
    alive = [long_tmpdir / f"autotuner-mp-{os.getpid()}-ghi", short_root / "autotuner-rank-xyz",
             short_root / f"other-{gone_pid}-x"]
    for path in dead + alive:
        path.mkdir()
    stopping.sweep_stale_temporary_dirs()
    assert [p.exists() for p in dead] == [False, False]
    assert all(p.exists() for p in alive)
