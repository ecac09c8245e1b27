"""Judge workers from their saved verification results: accept, undecided, suspect or reject.

    sglang-rl evidence --calibration cal.json results.jsonl [more ...]

Each input file holds verification results, as JSON lines or one JSON document: a result dict
(the parsed ``toploc_verification_fingerprint_validation_result``), the list that
``verify_response.py --json`` prints, or ``{"worker": NAME, "result": {...}}``. Results without a
worker name belong to the worker named after their file. Results are taken in file order; each
worker's running verdict is printed per result (``--quiet``: only the final line per worker).

The test is ``sglang_rl_client.evidence.WorkerEvidence`` with the calibration file's bounds
and score histograms (written by ``sglang-rl calibrate``); its false-accusation rate on
honest workers is at most alpha * (1 + N * floor) over N responses.
Exits 0 if no worker is rejected, 1 if one is, 2 on a usage error.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

from sglang_rl_client.calibration import CalibrationError, load_calibration
from sglang_rl_client.arguments import ArgumentParser
from sglang_rl_client.evidence import REJECT, EvidencePolicy, Fleet


def _results(item: Any, default_worker: str) -> Iterator[tuple[str, dict]]:
    """(worker, result dict) pairs inside one parsed JSON value."""
    if isinstance(item, list):
        for element in item:
            yield from _results(element, default_worker)
    elif isinstance(item, dict) and isinstance(item.get("result"), (dict, str)):
        result = item["result"]
        yield str(item.get("worker", default_worker)), json.loads(result) if isinstance(result, str) else result
    elif isinstance(item, dict) and ("chunks" in item or "error" in item):
        yield default_worker, item
    else:
        raise ValueError(f"not a verification result: {json.dumps(item)[:120]}")


def read_results(path: Path) -> Iterator[tuple[str, dict]]:
    """All (worker, result) pairs of a file, in order (one JSON document, or JSON lines)."""
    text = path.read_text()
    try:
        values = [json.loads(text)]
    except json.JSONDecodeError:
        values = [json.loads(line) for line in text.splitlines() if line.strip()]
    for value in values:
        yield from _results(value, path.stem)


def evidence_policy(alpha: float) -> EvidencePolicy:
    """The decision rule for a false-accusation level ``alpha`` (suspect at 0.05, or alpha above it)."""
    return EvidencePolicy(false_accusation_rate=alpha, suspect_level=max(0.05, alpha))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command; returns its exit code."""
    parser = ArgumentParser(description="Running worker verdicts from saved verification results.")
    parser.add_argument("results", type=Path, nargs="+", help="files of verification results")
    parser.add_argument("--calibration", required=True, type=Path, help="calibration file of the model")
    parser.add_argument("--alpha", type=float, default=1e-3, help="false-accusation level (default 1e-3)")
    parser.add_argument("--prior", type=float, default=0.5, help="prior probability that a worker cheats")
    parser.add_argument("--quiet", action="store_true", help="print only the final verdict per worker")
    parser.add_argument("--json", action="store_true", help="print the final states as JSON")
    args = parser.parse_args(argv)

    try:
        fleet = Fleet(load_calibration(args.calibration), evidence_policy(args.alpha), args.prior)
        for path in args.results:
            for name, result in read_results(path):
                verdict = fleet.add_report(name, result)
                w = fleet.workers[name]
                if not args.quiet and not args.json:
                    print(f"{name}: response {w.responses + w.errors}: verified={result.get('verified')} "
                          f"log-evidence {w.statistic:.2f} -> {verdict}")
    except (CalibrationError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    states = fleet.states()
    if args.json:
        print(json.dumps(states, indent=2))
    else:
        for name, s in states.items():
            print(f"{name}: {s['verdict'].upper()} after {s['responses']} responses "
                  f"({s['failed_responses']} failed, {s['errors']} errors), log-evidence "
                  f"{s['log_evidence']:.2f} (reject at {s['reject_at_log_evidence']:.2f}), "
                  f"P(cheat) {s['cheat_probability']:.3g}")
    return 1 if any(s["verdict"] == REJECT for s in states.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
