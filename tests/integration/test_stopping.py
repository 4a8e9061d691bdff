"""The stop guard's first Ctrl-C: leave at once while nothing has started, unwind once work has."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from autotuner.launch.stopping import Stopped, mark_work_started, stop_guard
    try:
        with stop_guard():
            if sys.argv[1] == "started":
                mark_work_started()
            os.kill(os.getpid(), signal.SIGINT)
            print("not stopped", flush=True)
    except Stopped as stop:
        print("unwound", flush=True)
        sys.exit(stop.exit_status)
""")


@pytest.mark.parametrize("phase, expected", [("before", ""), ("started", "unwound")])
def test_a_first_ctrl_c_leaves_at_once_only_before_the_run_owns_state(phase, expected):
    # With no child process yet, the guard used to leave at once even while the tuner wrote its
    # files against a Ray cluster: a half-written `.placement.json.*.tmp` stayed behind.
    done = subprocess.run([sys.executable, "-c", SCRIPT, phase], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, done.stderr
    assert done.stdout.strip() == expected
