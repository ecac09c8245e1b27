"""``sglang-rl-verify``: verify a file of rollouts on a verifier server, judge each worker.

    sglang-rl-verify ROLLOUTS.jsonl --server URL [--calibration FILE] [--api-key KEY]
                     [--out FILE] [--concurrency N]

Input: JSON lines, each with ``input_ids``, ``output_ids`` and ``fingerprint`` (or the response's
``toploc_verification_fingerprints``), optionally ``worker``, ``max_new_tokens`` (the limit the
response was generated with, for the termination check) and ``seeded_sampling`` (the claimed
``seed``, ``temperature``, ``top_p``, ``top_k``, ``min_p`` of a response generated with the seeded
sampler: every token is then recomputed); any other keys are carried to the output. Worker
records count each worker's verdict bands (pass, suspect, fail). Output (``--out``, else
stdout): JSON lines, one ``{"type": "response", ...}`` per input line in input order, then one ``{"type": "worker", ...}`` per worker and a ``{"type":
"summary", ...}``. A line that cannot be checked (not JSON, a key missing, a malformed
fingerprint, a server that refuses it, answers 5xx or does not answer after the retries) gets
``status: "error"`` and a one-line ``error``; the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Optional

from sglang_rl_client.arguments import EXIT_USAGE, ArgumentParser

EXIT_VERIFIED, EXIT_FAILED, EXIT_ERRORS = 0, 1, 3  # EXIT_USAGE (2): arguments.py
EXIT_CODES = f"""exit codes:
  {EXIT_VERIFIED}  every response verified (and, with --calibration, no worker suspect or rejected)
  {EXIT_FAILED}  some response failed verification, or a worker is suspect or rejected
  {EXIT_USAGE}  usage error: bad flags, unreadable rollouts or calibration file, --out not writable
  {EXIT_ERRORS}  nothing failed, but some lines could not be checked (errors)"""

API_KEY_ENV = "SGLANG_RL_API_KEY"
# worker verdicts without --calibration (with it: accept, undecided, suspect, reject)
ALL_VERIFIED, SOME_FAILED, UNCHECKED = "verified", "failed", "unchecked"


# --------------------------------------------------------------------------------------------
# reading rollouts


def read_rollouts(lines: Iterable[str], default_worker: str,
                  **expect: bool) -> Iterator[tuple[int, Any, Optional[str], dict]]:
    """(line number, Rollout or the exception that describes the line, the line's worker (None
    when the line is not a JSON object), the line's other keys) for every non-blank line."""
    from sglang_rl_client.verifier import RESERVED_KEYS, Rollout, RolloutError

    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            yield number, RolloutError(f"not JSON: {exc}"), None, {}
            continue
        if not isinstance(record, dict):
            yield number, RolloutError(f"expected a JSON object, got {type(record).__name__}"), None, {}
            continue
        kept = {k: v for k, v in record.items() if k not in RESERVED_KEYS}
        worker = default_worker if record.get("worker") is None else str(record["worker"])
        try:
            yield number, Rollout.from_dict(record, default_worker, **expect), worker, kept
        except RolloutError as exc:
            yield number, exc, worker, kept


def count_lines(path: Path) -> int:
    """Non-blank lines of a file (the progress bar's total)."""
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


# --------------------------------------------------------------------------------------------
# progress on stderr


class Progress:
    """A tqdm bar on stderr when tqdm is installed, else a plain counter; messages go above it."""

    def __init__(self, total: Optional[int], enabled: bool = True) -> None:
        self.counts = {"verified": 0, "failed": 0, "errors": 0}
        self.total = total
        self.enabled = enabled
        self.done = 0
        self._last = 0.0
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, unit="resp", desc="verifying", file=sys.stderr, dynamic_ncols=True)

    def message(self, text: str) -> None:
        """One line on stderr, without breaking the bar."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            self._clear()
            print(text, file=sys.stderr, flush=True)

    def update(self, status: str) -> None:
        """Count one finished item (verified, failed or error)."""
        self.counts["errors" if status == "error" else status] += 1
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix(self.counts, refresh=False)
            self._bar.update(1)
        elif self.enabled and (time.monotonic() - self._last > 0.5 or self.done == self.total):
            self._last = time.monotonic()
            of = f"/{self.total}" if self.total else ""
            sys.stderr.write(f"\rverifying {self.done}{of}: " + ", ".join(f"{k} {v}" for k, v in self.counts.items()))
            sys.stderr.flush()

    def _clear(self) -> None:
        if self.enabled and self.done:
            sys.stderr.write("\r\033[K" if sys.stderr.isatty() else "\n")

    def close(self) -> None:
        """End the bar (or the counter's line)."""
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.done:
            sys.stderr.write("\n")
            sys.stderr.flush()


# --------------------------------------------------------------------------------------------
# the run


class Tally:
    """Counts per worker and over the run, and the worker evidence when there is a calibration."""

    def __init__(self, fleet: Any = None) -> None:
        self.fleet = fleet
        self.workers: dict[str, dict[str, int]] = {}
        self.total = {"responses": 0, "verified": 0, "failed": 0, "errors": 0}

    def add(self, worker: Optional[str], status: str, result: Optional[dict]) -> None:
        """Account for one response of ``worker`` (None: a line whose worker is unknown)."""
        key = "errors" if status == "error" else status
        self.total["responses"] += 1
        self.total[key] += 1
        if worker is None:
            return
        counts = self.workers.setdefault(worker, {"responses": 0, "verified": 0, "failed": 0, "errors": 0,
                                                  "pass": 0, "suspect": 0, "fail": 0})
        counts["responses"] += 1
        counts[key] += 1
        if result is not None:
            from sglang_rl_client.bands import band_of_report

            band = band_of_report(result)
            if band is not None:
                counts[band] += 1
        if self.fleet is not None:
            if result is not None:
                self.fleet.add_report(worker, result)
            else:
                self.fleet.worker(worker)  # so that a worker with only errors is still listed

    def worker_records(self) -> list[dict[str, Any]]:
        """One output record per worker, with its verdict."""
        out = []
        for name, counts in self.workers.items():
            record: dict[str, Any] = {"type": "worker", "worker": name}
            if self.fleet is not None:
                state = self.fleet.workers[name].state()
                record.update(verdict=state["verdict"], **counts, evidence=state)
            else:
                checked = counts["verified"] + counts["failed"]
                verdict = SOME_FAILED if counts["failed"] else ALL_VERIFIED if checked else UNCHECKED
                record.update(verdict=verdict, **counts)
            out.append(record)
        return out

    def exit_code(self, workers: list[dict[str, Any]]) -> int:
        """The run's exit code (see EXIT_CODES)."""
        from sglang_rl_client.evidence import REJECT, SUSPECT

        if self.total["failed"] or any(w["verdict"] in (SUSPECT, REJECT) for w in workers):
            return EXIT_FAILED
        return EXIT_ERRORS if self.total["errors"] else EXIT_VERIFIED


def run(args: argparse.Namespace, lines: Iterator[str], out: IO[str], total: Optional[int], fleet: Any) -> int:
    """Verify every line, write the records, return the exit code."""
    from sglang_rl_client.verifier import VerifierClient

    client = VerifierClient(args.server, batch_size=args.batch_size, concurrency=args.concurrency,
                            api_key=args.api_key, timeout=args.timeout, retries=args.retries)
    default_worker = "stdin" if str(args.rollouts) == "-" else Path(args.rollouts).stem
    expect = {"expect_greedy": args.expect_greedy, "expect_sampled": args.expect_sampled}
    meta: list[tuple[int, Optional[str], dict]] = []  # per item: line number, worker, other keys

    def items() -> Iterator[Any]:
        for number, item, worker, kept in read_rollouts(lines, default_worker, **expect):
            meta.append((number, worker, kept))
            yield item

    tally = Tally(fleet)
    progress = Progress(total, enabled=not args.no_progress)
    try:
        for outcome in client.verify_many(items()):
            number, worker, kept = meta[outcome.index]
            record: dict[str, Any] = {"type": "response", "line": number, "worker": worker,
                                      "status": outcome.status, "verified": outcome.verified}
            if outcome.error is not None:
                record["error"] = outcome.error
                progress.message(f"line {number}: error: {outcome.error}")
            else:
                record["result"] = outcome.result
                if not outcome.verified:
                    progress.message(f"line {number}: not verified{_why(outcome.result)}")
            record["record"] = kept
            out.write(json.dumps(record) + "\n")
            tally.add(worker, outcome.status, outcome.result)
            progress.update(outcome.status)
    finally:
        progress.close()
    workers = tally.worker_records()
    for record in workers:
        out.write(json.dumps(record) + "\n")
    code = tally.exit_code(workers)
    verdicts: dict[str, int] = {}
    for record in workers:
        verdicts[record["verdict"]] = verdicts.get(record["verdict"], 0) + 1
    out.write(json.dumps({"type": "summary", **tally.total, "workers": verdicts, "exit_code": code}) + "\n")
    out.flush()
    t = tally.total
    print(f"{t['verified']} verified, {t['failed']} failed, {t['errors']} errors of {t['responses']} responses; "
          + ", ".join(f"{r['worker']}: {r['verdict']}" for r in workers), file=sys.stderr)
    return code


def _why(result: Optional[dict]) -> str:
    """A short reason for a failed verification, from its result."""
    if not result:
        return ""
    if "error" in result:
        return f" ({result['error']})"
    if result.get("verdict_reasons"):
        return f" ({result['verdict']}: " + "; ".join(result["verdict_reasons"]) + ")"
    parts = [f"worst exp_mismatches {result.get('worst_exp_mismatches')}",
             f"mant_err_mean {result.get('worst_mant_err_mean')}",
             f"mant_err_median {result.get('worst_mant_err_median')}"]
    if result.get("fingerprint_verified") and result.get("greedy_consistent") is False:
        parts.append("not greedy")
    if result.get("fingerprint_verified") and result.get("sampling_consistent") is False:
        parts.append(f"sampling Z {result.get('sampling_z')}")
    return " (" + ", ".join(parts) + ")"


def build_parser() -> ArgumentParser:
    """The command's flags."""
    parser = ArgumentParser(
        prog="sglang-rl-verify",
        description="Verify TOPLOC-fingerprinted rollouts on a verifier server (an sglang-rl server with "
                    "--toploc-verification serving the agreed model) and judge each worker.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rollouts", help="JSON-lines file (- for stdin): input_ids, output_ids, fingerprint, "
                        "optionally worker; other keys are kept in the output")
    parser.add_argument("--server", required=True, help="verifier base URL, e.g. http://verifier:30000")
    parser.add_argument("--calibration", type=Path, help="calibration file of the model (sglang-rl calibrate): "
                        "turns per-worker counts into the evidence test (accept/undecided/suspect/reject)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"sent as 'Authorization: Bearer KEY' (the server's --api-key; default: ${API_KEY_ENV})")
    parser.add_argument("--out", type=Path, help="write the JSON-lines results here (default: stdout)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--batch-size", type=int, default=8, help="responses per request (default 8)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request attempt (default 600)")
    parser.add_argument("--retries", type=int, default=3,
                        help="extra attempts after a connection error, timeout or 5xx, with backoff (default 3)")
    expect = parser.add_mutually_exclusive_group()
    expect.add_argument("--expect-greedy", action="store_true",
                        help="also require every response token to be the model's argmax (temperature-0 rollouts)")
    expect.add_argument("--expect-sampled", action="store_true",
                        help="also require the sampling test (rollouts sampled at temperature 1, no top-k/p)")
    parser.add_argument("--alpha", type=float, default=1e-3,
                        help="with --calibration: false-accusation level of the worker test (default 1e-3)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``sglang-rl-verify``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.batch_size < 1:
        parser.error("--concurrency and --batch-size must be at least 1")
    if args.retries < 0 or args.timeout <= 0:
        parser.error("--retries must not be negative and --timeout must be positive")
    if not args.server.startswith(("http://", "https://")):
        parser.error(f"--server must be an http:// or https:// URL, got {args.server!r}")
    fleet = None
    if args.calibration is not None:
        from sglang_rl_client.calibration import CalibrationError, load_calibration
        from sglang_rl_client.evidence import Fleet
        from sglang_rl_client.worker_evidence import evidence_policy

        try:
            fleet = Fleet(load_calibration(args.calibration), evidence_policy(args.alpha))
        except (CalibrationError, ValueError) as exc:
            parser.error(str(exc))
    try:
        if args.rollouts == "-":
            source, total = sys.stdin, None
        else:
            path = Path(args.rollouts)
            total = count_lines(path)
            source = path.open(encoding="utf-8", errors="replace")
    except OSError as exc:
        parser.error(f"cannot read {args.rollouts}: {exc.strerror}")
    try:
        out = args.out.open("w") if args.out is not None else sys.stdout
    except OSError as exc:
        parser.error(f"cannot write {args.out}: {exc.strerror}")
    try:
        return run(args, iter(source), out, total, fleet)
    finally:
        if out is not sys.stdout:
            out.close()
        if source is not sys.stdin:
            source.close()


if __name__ == "__main__":
    sys.exit(main())
