"""Host work of an Engine's processes over a timed window, read from /proc (Linux).

Per process role (the scheduler, the detokenizer, the co-training process, the Engine's own
process with its tokenizer manager): CPU seconds of all its threads and of its main thread, and
context switches summed over its threads. Involuntary switches are the kernel taking a runnable
thread off its core for another: where they rise in co-training windows, the scheduler is
competing for CPUs; where its CPU seconds per token rise, it does more host work itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

TICKS = os.sysconf("SC_CLK_TCK")

# command-line prefixes sglang and sglang-rl give their processes (setproctitle)
ROLES = {"scheduler": "sglang::scheduler", "detokenizer": "sglang::detokenizer", "trainer": "sglang-rl::drafter"}


def _thread(path: Path) -> Optional[dict]:
    """CPU seconds and context switches of one thread (None if it has exited meanwhile)."""
    try:
        stat = (path / "stat").read_text()
        status = (path / "status").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 onwards
    switches = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            switches[key] = int(value)
    return {"cpu_s": (int(fields[11]) + int(fields[12])) / TICKS,
            "vol": switches.get("voluntary_ctxt_switches", 0), "invol": switches.get("nonvoluntary_ctxt_switches", 0)}


def process_counters(pid: int) -> dict:
    """Summed over the threads now alive (a thread that ended takes its counts with it)."""
    total = {"cpu_s": 0.0, "vol": 0, "invol": 0, "threads": 0}
    main = None
    for task in Path(f"/proc/{pid}/task").iterdir():
        counts = _thread(task)
        if counts is None:
            continue
        total["threads"] += 1
        for key in ("cpu_s", "vol", "invol"):
            total[key] += counts[key]
        if int(task.name) == pid:
            main = counts
    total["main_cpu_s"] = main["cpu_s"] if main else 0.0
    total["main_invol"] = main["invol"] if main else 0
    return total


def host_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole host since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / TICKS, sum(values) / TICKS


def _descendants() -> list[tuple[Any, str]]:
    """This process's descendants with their command lines (those that exit meanwhile left out)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            found.append((child, " ".join(child.cmdline())))
        except psutil.Error:
            continue
    return found


def engine_processes(prefix: str) -> list:
    """This process's descendants whose command line starts with ``prefix``."""
    return [child for child, line in _descendants() if line.startswith(prefix)]


def engine_pids() -> dict[str, list[int]]:
    """Pids of this process's Engine by role (one walk of its descendants); ``engine`` is this process."""
    pids: dict[str, list[int]] = {"engine": [os.getpid()]}
    for child, line in _descendants():
        for role, prefix in ROLES.items():
            if line.startswith(prefix):
                pids.setdefault(role, []).append(child.pid)
    return pids


def snapshot(pids: dict[str, list[int]]) -> dict:
    out: dict[str, Any] = {"host": host_busy()}
    for role, group in pids.items():
        counts = [process_counters(pid) for pid in group if Path(f"/proc/{pid}").exists()]
        out[role] = {key: sum(c[key] for c in counts) for key in counts[0]} if counts else None
    return out


def usage(before: dict, after: dict, seconds: float, tokens: int) -> dict:
    """Per role over the window: CPU ms per 1000 output tokens (all threads, main thread), cores
    used, involuntary switches per second (all threads, main thread); and the host's busy cores."""
    (busy0, total0), (busy1, total1) = before["host"], after["host"]
    out: dict[str, Any] = {"host_busy_cores": round((busy1 - busy0) / max(total1 - total0, 1e-9) * (os.cpu_count() or 1), 2)}
    for role in after:
        if role == "host" or before.get(role) is None or after[role] is None:
            continue
        a, b = before[role], after[role]
        cpu = b["cpu_s"] - a["cpu_s"]
        out[role] = {"cpu_ms_per_1k_tok": round(1e6 * cpu / max(tokens, 1), 1),
                     "main_cpu_ms_per_1k_tok": round(1e6 * (b["main_cpu_s"] - a["main_cpu_s"]) / max(tokens, 1), 1),
                     "cores": round(cpu / seconds, 2),
                     "invol_per_s": round((b["invol"] - a["invol"]) / seconds, 1),
                     "main_invol_per_s": round((b["main_invol"] - a["main_invol"]) / seconds, 1),
                     "threads": b["threads"]}
    return out
