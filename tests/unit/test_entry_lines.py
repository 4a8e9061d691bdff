"""The launcher's lines reach a shared stream whole (app/entry.py's whole_lines): under sbatch the
launcher, srun and the agents write to one file, and a line written as two writes can be torn."""

from __future__ import annotations

import io
import sys

from autotuner.app import entry


class _Writes(io.RawIOBase):
    def __init__(self):
        self.calls: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.calls.append(bytes(data))
        return len(data)


def _stream(monkeypatch) -> _Writes:
    raw = _Writes()
    # as Python opens stderr: over the raw file, writing through, each write() call sent as it is
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, write_through=True))
    return raw


def test_a_write_through_stream_sends_print_s_text_and_newline_apart(monkeypatch):
    raw = _stream(monkeypatch)
    print("launcher: stopped by SIGTERM; stopping every node", file=sys.stderr)
    assert raw.calls == [b"launcher: stopped by SIGTERM; stopping every node", b"\n"]


def test_after_whole_lines_each_line_is_one_write_and_none_waits(monkeypatch):
    raw = _stream(monkeypatch)
    entry.whole_lines()
    print("launcher: stopped by SIGTERM; stopping every node", file=sys.stderr)
    print("launcher: node 1 (node2) exited with status 143", file=sys.stderr)
    assert raw.calls == [b"launcher: stopped by SIGTERM; stopping every node\n",
                         b"launcher: node 1 (node2) exited with status 143\n"]
