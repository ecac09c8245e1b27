"""JSON-lines files of the calibration tools (records, saved rollouts), gzip-compressed when the
name ends in .gz."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def json_lines(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line."""
    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode()
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            yield number, json.loads(line)


def write_json_lines(rows: Sequence[Any], path: str | Path, **dumps: Any) -> None:
    """One ``json.dumps(row, **dumps)`` per line (a fixed gzip mtime: the same rows, the same bytes)."""
    data = "".join(json.dumps(row, **dumps) + "\n" for row in rows).encode()
    Path(path).write_bytes(gzip.compress(data, mtime=0) if str(path).endswith(".gz") else data)
