"""The suite's servers run in the tests' session, each in a process group of its own.

A session is a scheduler autogroup where the kernel has them (/proc/sys/kernel/sched_autogroup_enabled):
CPU time is shared between autogroups first and by niceness only inside one, so a server in a session
of its own would take an equal share with the whole test run, whatever niceness the suite gave it
(the idle server waiting at the lowest priority, the unit tests at `nice -n 5`). Its own group is
what stopping it needs (killpg ends the launcher, scheduler and detokenizer at once).
"""

from __future__ import annotations

import os

import psutil


def test_a_servers_processes_share_the_tests_session_in_their_own_group(plain_server) -> None:
    launcher = psutil.Process(plain_server.proc.pid)
    tree = [launcher, *launcher.children(recursive=True)]
    titles = [" ".join(p.cmdline()) for p in tree]  # sglang retitles its processes (sglang::scheduler)
    assert any("scheduler" in title for title in titles), titles
    for proc in tree:
        assert os.getsid(proc.pid) == os.getsid(0), (proc.pid, proc.cmdline()[:3])
        assert os.getpgid(proc.pid) == launcher.pid, (proc.pid, proc.cmdline()[:3])
    assert os.getpgid(0) != launcher.pid
