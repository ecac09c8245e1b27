"""Where an "on" run's scheduler thread spends more time than an "off" run's: two torch profiler
traces of sglang's scheduler (`bench_toploc.py --paired --profile-dir DIR`), compared per step.

For each of sglang's loop phases (its `scheduler.*` profiler spans, and the speculative stages
`draft`, `verify`, `draft_extend` inside them) the table gives the host time per step of each
mode, then the ops (aten calls, CUDA runtime calls) whose time per step grew most inside them,
and the device's kernel and copy time per step by stream:

    python benchmark/scheduler_timing/trace_diff.py DIR/64x128x128-off DIR/64x128x128-on

A step is one `scheduler.run_batch` span. Ops are filed under the innermost span that holds
them, on the scheduler's thread (the one with the most run_batch spans); an op that nests in
another op counts once, under the outer one.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

SPANS = ("scheduler.", "draft", "verify", "draft_extend")
TOP_OPS = 12


def load(folder: str) -> list[dict]:
    """The events of the one trace file in `folder` (gzipped or not)."""
    files = sorted(Path(folder).glob("*.trace.json*"))
    if not files:
        raise SystemExit(f"no trace in {folder}")
    opener = gzip.open if files[0].suffix == ".gz" else open
    with opener(files[0], "rt") as f:
        return json.load(f)["traceEvents"]


def _is_span(event: dict) -> bool:
    return event.get("cat") == "user_annotation" and event["name"].startswith(SPANS)


def summarise(events: list[dict]) -> dict:
    """Per-step host time of each span, op time per span, and device time per stream."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    runs_by_tid: dict = defaultdict(int)
    for e in complete:
        if e.get("cat") == "user_annotation" and e["name"] == "scheduler.run_batch":
            runs_by_tid[(e["pid"], e["tid"])] += 1
    if not runs_by_tid:
        raise SystemExit("no scheduler.run_batch span in the trace")
    thread = max(runs_by_tid, key=runs_by_tid.get)
    steps = runs_by_tid[thread]
    host = sorted((e for e in complete if (e["pid"], e["tid"]) == thread), key=lambda e: (e["ts"], -e["dur"]))
    spans: dict[str, float] = defaultdict(float)
    ops: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    stack: list[dict] = []  # open spans and ops, outermost first
    for e in host:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        if _is_span(e):
            spans[e["name"]] += e["dur"]
            stack.append(e)
            continue
        if e.get("cat") not in ("cpu_op", "cuda_runtime", "cuda_driver"):
            continue
        if any(not _is_span(s) for s in stack):
            continue  # nested inside another op: counted with it
        inner = next((s["name"] for s in reversed(stack) if _is_span(s)), "(outside spans)")
        cell = ops[(inner, e["name"])]
        cell[0] += e["dur"]
        cell[1] += 1
        stack.append(e)
    device: dict[str, float] = defaultdict(float)
    for e in complete:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            device[f"{e['cat']} stream {e.get('args', {}).get('stream', '?')}"] += e["dur"]
    return {"steps": steps, "spans": {k: v / steps for k, v in spans.items()},
            "ops": {k: (v[0] / steps, v[1] / steps) for k, v in ops.items()},
            "device": {k: v / steps for k, v in device.items()}}


def main() -> int:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    off, on = (summarise(load(folder)) for folder in sys.argv[1:])
    print(f"steps: off {off['steps']}, on {on['steps']}; us per step")
    print("| span | off | on | on - off |")
    print("|---|---|---|---|")
    for name in sorted(set(off["spans"]) | set(on["spans"])):
        a, b = off["spans"].get(name, 0.0), on["spans"].get(name, 0.0)
        print(f"| {name} | {a:.0f} | {b:.0f} | {b - a:+.0f} |")
    print(f"\nops whose time per step grew most (top {TOP_OPS}; calls per step in brackets)")
    print("| span | op | off | on | on - off |")
    print("|---|---|---|---|---|")
    keys = set(off["ops"]) | set(on["ops"])
    grown = sorted(keys, key=lambda k: on["ops"].get(k, (0, 0))[0] - off["ops"].get(k, (0, 0))[0], reverse=True)
    for key in grown[:TOP_OPS]:
        a, b = off["ops"].get(key, (0.0, 0.0)), on["ops"].get(key, (0.0, 0.0))
        print(f"| {key[0]} | {key[1]} | {a[0]:.1f} ({a[1]:.2f}) | {b[0]:.1f} ({b[1]:.2f}) | {b[0] - a[0]:+.1f} |")
    print("\ndevice time per step")
    print("| stream | off | on |")
    print("|---|---|---|")
    for name in sorted(set(off["device"]) | set(on["device"])):
        print(f"| {name} | {off['device'].get(name, 0.0):.0f} | {on['device'].get(name, 0.0):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
