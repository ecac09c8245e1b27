"""What limits delivering many base64 payloads at once? Times each part of the API-side delivery
of N requests' rows (read the row file, base64-encode, allocate the output) serially and in a
thread pool, without a model. Prints a table; run it on the host whose numbers you want.

    python benchmark/bench_delivery_threads.py                 # 64 payloads of 257 rows x 4096 bf16
    python benchmark/bench_delivery_threads.py --rows 1025 --threads 4 16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pybase64

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402


def _parts(paths: list[str], size: int) -> dict:
    """One function per part of a delivery, each taking one payload's file path."""
    from sglang_rl.hidden_states.row_segments import scratch_buffer

    sources = {p: os.urandom(size) for p in paths}

    def read_fresh(path: str) -> object:
        buf = bytearray(size)
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
        return buf

    def read_reused(path: str) -> object:
        view = scratch_buffer(size)
        with open(path, "rb", buffering=0) as f:
            f.readinto(view)
        return None

    def encode_only(path: str) -> object:
        return pybase64.b64encode_as_string(sources[path])

    def encode_into_bytes(path: str) -> object:
        return pybase64.b64encode(sources[path])

    def touch_new_memory(path: str) -> object:
        return b"\x01" * (size * 4 // 3)  # an output-sized allocation, every page written

    def read_and_encode(path: str) -> object:
        view = scratch_buffer(size)
        with open(path, "rb", buffering=0) as f:
            f.readinto(view)
        return pybase64.b64encode_as_string(view)

    return {"read, fresh buffer": read_fresh, "read, reused buffer": read_reused,
            "base64 to str": encode_only, "base64 to bytes": encode_into_bytes,
            "allocate+write output size": touch_new_memory, "read reused + base64 str": read_and_encode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--payloads", type=int, default=64)
    p.add_argument("--rows", type=int, default=257, help="rows per payload (257: 128 + 129 tokens)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--threads", type=int, nargs="+", default=[4, 16])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    size = args.rows * args.hidden * 2
    folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    paths = []
    for i in range(args.payloads):
        path = os.path.join(folder, f"rows{i}")
        with open(path, "wb") as f:
            f.write(os.urandom(size))
        paths.append(path)
    table = []
    for name, fn in _parts(paths, size).items():
        row = {"part": name}
        for threads in [1] + args.threads:
            best = float("inf")
            for _ in range(args.repeats):
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(fn, paths[:1]))  # start the threads before timing
                    t = time.perf_counter()
                    out = list(pool.map(fn, paths))
                    best = min(best, time.perf_counter() - t)
                del out
            row[f"{threads} thr ms"] = round(best * 1e3, 1)
        table.append(row)
    for path in paths:
        os.unlink(path)
    os.rmdir(folder)
    print(f"\n{args.payloads} payloads of {size / 2**20:.2f} MB (base64 {size * 4 / 3 / 2**20:.2f} MB), "
          f"{os.cpu_count()} CPUs; best of {args.repeats}")
    print_table(table, ["part"] + [f"{t} thr ms" for t in [1] + args.threads])


if __name__ == "__main__":
    main()
