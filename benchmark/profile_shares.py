"""Where a scheduler's time went, from py-spy raw profiles: one column per profile.

Record each mode on its own, with idle samples so that waits count as time:
    py-spy record --subprocesses --idle -r 200 -f raw -o off.txt -- python benchmark/bench_toploc.py --modes off ...
    py-spy record --subprocesses --idle -r 200 -f raw -o on.txt -- python benchmark/bench_toploc.py --modes on ...
    python benchmark/profile_shares.py off.txt on.txt

Only the samples of threads in the scheduler's event loop count. Each row is the number of those
samples whose stack holds a frame (inclusive), so at a fixed rate a row is time; the difference
between two columns is where one mode spent more time than the other.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

LOOP = re.compile(r"^Scheduler\.event_loop")
FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:]+)(:\d+)?\)$")


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy raw lines: 'frame;frame;... count', outermost frame first."""
    stacks = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or " " not in line:
            continue
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def frame_name(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'to/file.py:func' (lines dropped so versions compare)."""
    m = FRAME.match(frame)
    if not m:
        return frame
    return f"{'/'.join(Path(m['file']).parts[-2:])}:{m['func']}"


def loop_stacks(stacks: list[tuple[list[str], int]]) -> list[tuple[list[str], int]]:
    """The stacks of the scheduler's event loop, cut to the frames from `Scheduler.event_loop*` on."""
    found = []
    for frames, count in stacks:
        for i, frame in enumerate(frames):
            if LOOP.match(frame):
                found.append(([frame_name(f) for f in frames[i:]], count))
                break
    return found


def inclusive(stacks: list[tuple[list[str], int]]) -> Counter:
    """Samples per frame name, each stack counted once per name it holds."""
    counts: Counter = Counter()
    for frames, count in stacks:
        for name in set(frames):
            counts[name] += count
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profiles", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=40, help="rows: the frames whose counts differ most (the largest, for one profile)")
    p.add_argument("--match", default="", help="only frames whose name (folder/file.py:function) contains this")
    args = p.parse_args()
    columns = [inclusive(loop_stacks(read_raw(path))) for path in args.profiles]
    totals = [sum(c for frames, c in loop_stacks(read_raw(path))) for path in args.profiles]
    names = {n for col in columns for n in col if args.match in n}
    if len(columns) == 1:
        spread = sorted(names, key=lambda n: -columns[0][n])
    else:
        spread = sorted(names, key=lambda n: -(max(c[n] for c in columns) - min(c[n] for c in columns)))
    head = ["frame"] + [path.name for path in args.profiles]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    print("| (all event-loop samples) | " + " | ".join(str(t) for t in totals) + " |")
    for name in spread[: args.top]:
        print(f"| {name} | " + " | ".join(str(col[name]) for col in columns) + " |")


if __name__ == "__main__":
    main()
