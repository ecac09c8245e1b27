"""Where the scheduler's time goes with co-training on and off: the py-spy samples that
`bench_cotrain.py speed --cost-paired --cost-profile DIR` writes per window (CONFIG_onI.txt,
CONFIG_offI.txt, raw collapsed stacks), summed over each config's on and off windows. Prints, per
config, the functions whose share of the scheduler's samples (inclusive: the function or anything
it calls) differs most between the two, and each side's samples.

    python benchmark/profile_diff.py DIR [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402


def inclusive_counts(files: list[Path]) -> tuple[collections.Counter, int]:
    """Samples per function (``name (file)``, lines dropped), each counted once per stack."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for path in files:
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not n.isdigit():
                continue
            total += int(n)
            for frame in {re.sub(r":\d+\)$", ")", f) for f in stack.split(";")}:
                counts[frame] += int(n)
    return counts, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    files = sorted(Path(args.dir).glob("*_on*.txt"))
    for config in sorted({f.name.rsplit("_on", 1)[0] for f in files}):
        on, on_total = inclusive_counts(sorted(Path(args.dir).glob(f"{config}_on*.txt")))
        off, off_total = inclusive_counts(sorted(Path(args.dir).glob(f"{config}_off*.txt")))
        if not on_total or not off_total:
            continue
        rows = [{"function": name[:110], "on_share": round(on[name] / on_total, 4),
                 "off_share": round(off[name] / off_total, 4),
                 "difference": round(on[name] / on_total - off[name] / off_total, 4)}
                for name in set(on) | set(off)]
        rows.sort(key=lambda r: -abs(r["difference"]))
        print(f"\n## {config}: {on_total} samples with co-training, {off_total} opted out")
        print_table(rows[:args.top], ["function", "on_share", "off_share", "difference"])


if __name__ == "__main__":
    main()
