"""The guard that keeps the end of a dead rank's process group from hitting anything else: a
pid is a group's id, and a live process with the leader's pid but another start time is a new
process, whose group is left alone."""

from __future__ import annotations

import os

import psutil

from autotuner.launch.rank_groups import RankGroup, _still_the_rank_or_gone, end_rank_groups, group_led_by


def test_a_live_process_with_the_leaders_pid_but_another_start_time_is_not_the_rank():
    me = psutil.Process()
    assert _still_the_rank_or_gone(RankGroup(me.pid, me.create_time()))
    assert not _still_the_rank_or_gone(RankGroup(me.pid, me.create_time() - 60.0))  # pid reused
    assert not _still_the_rank_or_gone(RankGroup(me.pid, None))  # never seen alive: cannot tell


def test_our_own_group_and_a_reused_pid_are_never_ended():
    me = psutil.Process()
    assert end_rank_groups([RankGroup(os.getpgrp(), None), RankGroup(me.pid, me.create_time() - 60.0)]) == []


def test_only_a_group_leader_is_noted():
    me = psutil.Process()
    led = group_led_by(me)
    assert (led is not None) == (os.getpgid(me.pid) == me.pid)


def test_a_rank_is_known_by_its_pid_and_start_time_and_one_gone_already_by_its_pid():
    from autotuner.launch.rank_groups import group_of_rank

    me = psutil.Process()
    assert group_of_rank(me.pid) == RankGroup(me.pid, me.create_time())
    assert group_of_rank(2**22 + 12345).started is None  # above any pid the kernel hands out by default
