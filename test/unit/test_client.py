"""The client package (sglang_rl_client) against a tiny local HTTP verifier: batching, order,
retries, timeouts, the API key, bad lines, worker verdicts and the exit codes of sglang-rl-verify.
Also: it imports and runs with torch, numpy, sglang, toploc, requests and tqdm blocked, and it
builds as a wheel with no required dependency."""

from __future__ import annotations

import base64
import json
import math
import shutil
import struct
import subprocess
import sys
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from sglang_rl_client import (
    Fingerprint,
    Rollout,
    ServerError,
    Transport,
    VerifierClient,
    encode_fingerprint,
)
from sglang_rl_client import cli
from sglang_rl_client.calibration import Calibration, ScoreHistogram, Thresholds
from sglang_rl_client.evidence import DEFAULT_EDGES

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"
NO_SLEEP = {"sleep": lambda seconds: None}

# the fake verifier's answer per item is chosen by the item's first token id
HONEST, CHEAT, FAILS, REFUSED = 1, 2, 3, 4


def fingerprint(n_rows: int, topk: int = 4, chunk_size: int = 32) -> str:
    proof = struct.pack(f">{topk + 1}H", 65497, *range(1, topk + 1))
    return encode_fingerprint(Fingerprint(topk, chunk_size, n_rows, (proof,) * -(-n_rows // chunk_size)))


def rollout_line(kind: int, n: int = 40, worker: str | None = None, **extra: Any) -> dict:
    line = {"input_ids": [kind, 7, 8], "output_ids": list(range(10, 10 + n)), "fingerprint": fingerprint(n), **extra}
    if worker is not None:
        line["worker"] = worker
    return line


def chunk(exp: int) -> dict:
    return {"exp_mismatches": exp, "mant_err_mean": 0.0, "mant_err_median": 0.0}


def fake_result(ids: list[int], fp: str) -> dict:
    n = struct.unpack(">I", base64.b64decode(fp)[6:10])[0]
    exp = {HONEST: 0, CHEAT: 5, FAILS: 60}[ids[0]]
    chunks = [chunk(exp)] * -(-n // 32)
    verified = exp <= 38
    return {"verified": verified, "fingerprint_verified": verified, "num_chunks": len(chunks), "chunks": chunks,
            "response_tokens": n, "response_start": len(ids) - n, "worst_exp_mismatches": exp,
            "worst_mant_err_mean": 0.0, "worst_mant_err_median": 0.0, "echo": ids[0]}


class QuietHTTPServer(ThreadingHTTPServer):
    """A client that gave up (a retry test's timeout) breaks the reply's pipe; socketserver would
    print that to whatever stderr a later test is capturing."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class FakeVerifier:
    """A /generate endpoint that answers verification requests like an sglang-rl verifier, with
    failures on demand: `fail_next` answers 503 that many times, `delay` sleeps before answering,
    `api_key` demands that bearer token. `before_answer(body)`, when set, runs in the request's
    thread before the answer (a concurrency test's barrier); `peak` is the most requests that were
    in flight at once."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.fail_next = 0
        self.always_fail = False
        self.delay = 0.0
        self.api_key: str | None = None
        self.before_answer: Any = None
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                with owner.lock:
                    owner.in_flight += 1
                    owner.peak = max(owner.peak, owner.in_flight)
                self.counted = True
                try:
                    self.answer()
                finally:
                    self.uncount()

            def uncount(self) -> None:
                """Out of flight before the answer goes (the client may send its next request then)."""
                if getattr(self, "counted", False):
                    self.counted = False
                    with owner.lock:
                        owner.in_flight -= 1

            def answer(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.requests.append(body)
                    owner.headers.append(dict(self.headers))
                    fail = owner.always_fail or owner.fail_next > 0
                    owner.fail_next -= owner.fail_next > 0
                if owner.before_answer is not None:
                    if owner.before_answer(body) is False:
                        return self.reply(503, {"error": "refused by the test"})
                if owner.delay:
                    time.sleep(owner.delay)
                if owner.api_key and self.headers.get("Authorization") != f"Bearer {owner.api_key}":
                    return self.reply(401, {"error": "Unauthorized"})
                if fail:
                    return self.reply(503, {"error": "overloaded\nretry later"})
                batch = isinstance(body["input_ids"][0], list)
                ids = body["input_ids"] if batch else [body["input_ids"]]
                fps = body["toploc_verification_fingerprint_to_validate"]
                fps = fps if batch else [fps]
                params = body["sampling_params"] if batch else [body["sampling_params"]]
                if any(p.get("max_new_tokens") != 0 for p in params):
                    return self.reply(400, {"error": "not prefill-only"})
                if any(i[0] == REFUSED for i in ids):
                    return self.reply(400, {"error": "invalid toploc_verification_fingerprint_to_validate"})
                answers = [{"text": "", "meta_info": {
                    "toploc_verification_fingerprint_validation_result": json.dumps(fake_result(i, fp))}}
                    for i, fp in zip(ids, fps)]
                self.reply(200, answers if batch else answers[0])

            def reply(self, status: int, doc: Any) -> None:
                self.uncount()
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def verifier() -> Iterator[FakeVerifier]:
    server = FakeVerifier()
    yield server
    server.close()


def closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# --------------------------------------------------------------------------------------------
# the API


def test_outcomes_come_in_input_order_from_concurrent_batches(verifier: FakeVerifier) -> None:
    rollouts = [Rollout.from_dict(rollout_line((HONEST, CHEAT, FAILS)[i % 3], n=1 + i * 5)) for i in range(20)]
    client = VerifierClient(verifier.url, batch_size=3, concurrency=4)
    outcomes = list(client.verify_many(rollouts))
    assert [o.index for o in outcomes] == list(range(20))
    assert [o.result["echo"] for o in outcomes] == [r.input_ids[0] for r in rollouts]
    assert [o.result["response_tokens"] for o in outcomes] == [1 + i * 5 for i in range(20)]
    assert [o.status for o in outcomes] == [("verified", "verified", "failed")[i % 3] for i in range(20)]
    assert len(verifier.requests) == 7  # ceil(20 / 3) batched requests
    first = verifier.requests[0] if len(verifier.requests[0]["input_ids"]) == 3 else None
    assert first is None or first["sampling_params"] == [{"max_new_tokens": 0}] * 3
    single = VerifierClient(verifier.url, batch_size=1).verify(rollouts[0])
    assert single["verified"] is True and isinstance(verifier.requests[-1]["input_ids"][0], int)


def test_expectations_travel_per_item(verifier: FakeVerifier) -> None:
    line = rollout_line(HONEST)
    items = [Rollout.from_dict(line, expect_greedy=True), Rollout.from_dict(line, expect_sampled=True)]
    list(VerifierClient(verifier.url).verify_many(items))
    assert verifier.requests[0]["sampling_params"] == [
        {"max_new_tokens": 0, "toploc_verification_expect_greedy": True},
        {"max_new_tokens": 0, "toploc_verification_expect_sampled": True}]


def test_a_seeded_claim_travels_as_sglangs_sampling_fields(verifier: FakeVerifier) -> None:
    line = {**rollout_line(HONEST), "seeded_sampling": {"seed": 7, "temperature": 0.7, "top_p": 0.9}}
    rollout = Rollout.from_dict(line)
    assert "seeded_sampling" not in rollout.data
    list(VerifierClient(verifier.url).verify_many([rollout]))
    assert verifier.requests[0]["sampling_params"] == {
        "max_new_tokens": 0, "toploc_verification_expect_seeded": True, "sampling_seed": 7,
        "temperature": 0.7, "top_p": 0.9}


@pytest.mark.parametrize("claim,expect,reason", [
    ({"temperature": 0.7}, {}, "seeded_sampling needs an integer seed, got None"),
    ({"seed": "7"}, {}, "seeded_sampling needs an integer seed, got '7'"),
    ({"seed": 7, "topp": 0.9}, {}, "seeded_sampling has unknown key(s) topp"),
    ([7], {}, "seeded_sampling must be an object, got list"),
    ({"seed": 7}, {"expect_greedy": True}, "seeded_sampling excludes expect_greedy and expect_sampled"),
])
def test_bad_seeded_claims_are_refused_locally(verifier: FakeVerifier, claim, expect, reason) -> None:
    rollout = Rollout.from_dict({**rollout_line(HONEST), "seeded_sampling": claim}, **expect)
    [outcome] = list(VerifierClient(verifier.url).verify_many([rollout]))
    assert outcome.status == "error" and reason in outcome.error, outcome.error
    assert verifier.requests == []


def test_5xx_is_retried_with_backoff_then_succeeds(verifier: FakeVerifier) -> None:
    verifier.fail_next = 2
    slept: list[float] = []
    client = VerifierClient(verifier.url, retries=3, backoff=0.25, sleep=slept.append)
    assert client.verify(Rollout.from_dict(rollout_line(HONEST)))["verified"] is True
    assert len(verifier.requests) == 3 and slept == [0.25, 0.5]


def test_5xx_every_time_is_an_error_after_the_retries(verifier: FakeVerifier) -> None:
    verifier.always_fail = True
    outcomes = list(VerifierClient(verifier.url, retries=2, **NO_SLEEP).verify_many(
        [Rollout.from_dict(rollout_line(HONEST))] * 2))
    assert len(verifier.requests) == 3  # one batch, tried three times
    for outcome in outcomes:
        assert outcome.status == "error" and outcome.verified is None
        assert outcome.error.startswith("HTTP 503 from ") and "(after 3 attempts)" in outcome.error
        assert "\n" not in outcome.error


def test_no_server_and_no_answer_are_errors_after_the_retries(verifier: FakeVerifier) -> None:
    with pytest.raises(ServerError, match=r"cannot reach .* \(after 2 attempts\)") as caught:
        Transport(closed_port_url(), retries=1, **NO_SLEEP).post("/generate", {})
    assert caught.value.retryable and caught.value.status is None
    verifier.delay = 0.5
    with pytest.raises(ServerError, match=r"no answer from .* within 0.1 s \(after 2 attempts\)"):
        Transport(verifier.url, timeout=0.1, retries=1, **NO_SLEEP).post("/generate", {})
    assert len(verifier.requests) == 2


def test_a_refused_item_fails_alone_and_4xx_is_not_retried(verifier: FakeVerifier) -> None:
    kinds = [HONEST, REFUSED, CHEAT, HONEST]
    outcomes = list(VerifierClient(verifier.url, batch_size=4, **NO_SLEEP).verify_many(
        Rollout.from_dict(rollout_line(k)) for k in kinds))
    assert [o.status for o in outcomes] == ["verified", "error", "verified", "verified"]
    assert outcomes[1].error.startswith("HTTP 400 from") and "invalid toploc" in outcomes[1].error
    assert len(verifier.requests) == 1 + 4  # the batch, then each item alone


def test_malformed_items_are_refused_locally(verifier: FakeVerifier) -> None:
    good = rollout_line(HONEST, n=40)
    items = [
        Rollout([1], good["output_ids"], good["fingerprint"][:-4]),
        Rollout([1], good["output_ids"][:-1], good["fingerprint"]),
        Rollout([1, "x"], good["output_ids"], good["fingerprint"]),
        Rollout([], good["output_ids"], good["fingerprint"]),
        ValueError("line 9: not JSON"),
        Rollout.from_dict(good),
    ]
    outcomes = list(VerifierClient(verifier.url).verify_many(items))
    assert [o.status for o in outcomes] == ["error"] * 5 + ["verified"]
    assert "invalid fingerprint" in outcomes[0].error
    assert outcomes[1].error == "the fingerprint covers 40 tokens, output_ids holds 39"
    assert "input_ids must be a list of non-negative integer token ids" in outcomes[2].error
    assert "input_ids is empty" in outcomes[3].error
    assert outcomes[4].error == "line 9: not JSON" and outcomes[4].rollout is None
    assert len(verifier.requests) == 1 and len(verifier.requests[0]["input_ids"]) == 43


def test_the_api_key_is_sent_as_a_bearer_token(verifier: FakeVerifier) -> None:
    verifier.api_key = "s3cret"
    item = Rollout.from_dict(rollout_line(HONEST))
    assert VerifierClient(verifier.url, api_key="s3cret").verify(item)["verified"] is True
    assert verifier.headers[-1]["Authorization"] == "Bearer s3cret"
    with pytest.raises(ServerError, match="HTTP 401") as caught:
        VerifierClient(verifier.url, api_key="wrong", **NO_SLEEP).verify(item)
    assert not caught.value.retryable


def test_from_dict_keeps_the_other_keys_and_reads_response_fields() -> None:
    line = rollout_line(HONEST, worker="w1", request_id="r-7", step=3)
    rollout = Rollout.from_dict(line)
    assert rollout.worker == "w1" and rollout.data == {"request_id": "r-7", "step": 3}
    response_style = {"input_ids": [1], "output_ids": [2], "toploc_verification_fingerprints": ["A", "B"]}
    assert Rollout.from_dict(response_style, worker="default").fingerprint == "B"
    assert Rollout.from_dict(response_style, worker="default").worker == "default"
    with pytest.raises(ValueError, match="missing keys 'output_ids', 'fingerprint'"):
        Rollout.from_dict({"input_ids": [1]})


# --------------------------------------------------------------------------------------------
# the command


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def run_cli(tmp_path: Path, server: str, lines: list[Any], *flags: str) -> tuple[int, list[dict]]:
    rollouts = write_lines(tmp_path / "rollouts.jsonl", lines)
    out = tmp_path / "out.jsonl"
    code = cli.main([str(rollouts), "--server", server, "--out", str(out), "--no-progress", "--retries", "1",
                     "--timeout", "5", *flags])
    return code, [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


def test_cli_reports_every_line_and_goes_on_after_bad_ones(
    tmp_path: Path, verifier: FakeVerifier, capsys: pytest.CaptureFixture
) -> None:
    lines = [
        rollout_line(HONEST, worker="a", request_id="r0"),
        "{not json",
        "",
        {"input_ids": [1, 2], "worker": "b", "request_id": "r3"},
        rollout_line(FAILS, worker="b", request_id="r4"),
        rollout_line(REFUSED, worker="a", request_id="r5"),
        rollout_line(CHEAT, request_id="r6"),
    ]
    code, records = run_cli(tmp_path, verifier.url, lines, "--batch-size", "2", "--concurrency", "2")
    assert code == cli.EXIT_FAILED
    responses = [r for r in records if r["type"] == "response"]
    assert [(r["line"], r["status"]) for r in responses] == [
        (1, "verified"), (2, "error"), (4, "error"), (5, "failed"), (6, "error"), (7, "verified")]
    assert responses[0]["record"] == {"request_id": "r0"} and responses[0]["result"]["verified"] is True
    assert responses[1]["error"].startswith("not JSON: ") and responses[1]["worker"] is None
    assert responses[2]["error"] == "missing keys 'output_ids', 'fingerprint'" and responses[2]["worker"] == "b"
    assert responses[2]["record"] == {"request_id": "r3"}
    assert responses[4]["error"].startswith("HTTP 400") and responses[4]["verified"] is None
    assert responses[5]["worker"] == "rollouts"  # no worker key: named after the file
    workers = {r["worker"]: r for r in records if r["type"] == "worker"}
    assert workers["a"]["verdict"] == "verified" and (workers["a"]["verified"], workers["a"]["errors"]) == (1, 1)
    assert workers["b"]["verdict"] == "failed" and (workers["b"]["failed"], workers["b"]["errors"]) == (1, 1)
    assert workers["rollouts"]["verdict"] == "verified"
    summary = records[-1]
    assert summary == {"type": "summary", "responses": 6, "verified": 2, "failed": 1, "errors": 3,
                       "workers": {"verified": 2, "failed": 1}, "exit_code": 1}
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("line ")]
    assert "line 2: error: not JSON: " in err[0] and err[1] == "line 4: error: missing keys 'output_ids', 'fingerprint'"
    assert err[2].startswith("line 5: not verified (worst exp_mismatches 60")


def test_cli_exit_codes(tmp_path: Path, verifier: FakeVerifier) -> None:
    assert run_cli(tmp_path, verifier.url, [rollout_line(HONEST)] * 3)[0] == cli.EXIT_VERIFIED
    assert run_cli(tmp_path, verifier.url, [rollout_line(HONEST), "[1, 2]"])[0] == cli.EXIT_ERRORS
    assert run_cli(tmp_path, verifier.url, [rollout_line(HONEST), rollout_line(FAILS), "x"])[0] == cli.EXIT_FAILED
    code, records = run_cli(tmp_path, closed_port_url(), [rollout_line(HONEST)] * 2)
    assert code == cli.EXIT_ERRORS and records[-1]["errors"] == 2
    assert "cannot reach" in records[0]["error"]
    verifier.always_fail = True
    assert run_cli(tmp_path, verifier.url, [rollout_line(HONEST)])[0] == cli.EXIT_ERRORS


@pytest.mark.parametrize("flags, message", [
    (("--concurrency", "0"), "--concurrency and --batch-size must be at least 1"),
    (("--calibration", "/nonexistent/cal.json"), "cannot read the calibration file"),
    (("--server", "localhost:30000"), "--server must be an http:// or https:// URL"),
    (("--expect-greedy", "--expect-sampled"), "not allowed with argument"),
])
def test_cli_usage_errors_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, flags: tuple, message: str
) -> None:
    rollouts = write_lines(tmp_path / "r.jsonl", [rollout_line(HONEST)])
    with pytest.raises(SystemExit) as caught:
        cli.main([str(rollouts), "--server", "http://127.0.0.1:9", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert caught.value.code == cli.EXIT_USAGE and len(err) == 1 and message in err[0], err
    with pytest.raises(SystemExit) as caught:
        cli.main([str(tmp_path / "missing.jsonl"), "--server", "http://127.0.0.1:9"])
    assert caught.value.code == cli.EXIT_USAGE and "cannot read" in capsys.readouterr().err


def test_cli_help_documents_the_exit_codes(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out and all(f"  {code}  " in out for code in range(4))


def calibration_file(path: Path) -> Path:
    honest = (300, 200, 150, 100, 50, 20, 5) + (0,) * 13
    cheat = (10, 10, 20, 40, 60, 100, 100, 60, 30, 10) + (0,) * 10
    cal = Calibration("tiny", "/m", 4, 32, 1e-3, Thresholds(10, 2.0, 2.0), None, {},
                      ScoreHistogram(DEFAULT_EDGES, honest, {"cheat": cheat}), "test")
    path.write_text(json.dumps(cal.to_dict()))
    return path


def test_cli_judges_workers_with_a_calibration(tmp_path: Path, verifier: FakeVerifier) -> None:
    """Every response of both workers verifies, but the cheat's chunks sit at half the calibrated
    bound, which the honest histogram rarely shows: the evidence test rejects that worker."""
    lines = [rollout_line(k, worker=w) for _ in range(12) for k, w in ((HONEST, "honest"), (CHEAT, "cheat"))]
    cal = calibration_file(tmp_path / "cal.json")
    code, records = run_cli(tmp_path, verifier.url, lines, "--calibration", str(cal))
    workers = {r["worker"]: r for r in records if r["type"] == "worker"}
    assert code == cli.EXIT_FAILED and records[-1]["failed"] == 0
    assert workers["honest"]["verdict"] == "accept" and workers["cheat"]["verdict"] == "reject"
    assert workers["cheat"]["evidence"]["responses"] == 12 and workers["cheat"]["evidence"]["rejected_at_response"]
    code, records = run_cli(tmp_path, verifier.url, lines[::2] + ["oops"], "--calibration", str(cal))
    assert code == cli.EXIT_ERRORS and records[-1]["workers"] == {"accept": 1}


def test_plain_progress_counter_without_tqdm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` raises ImportError
    progress = cli.Progress(total=2)
    progress.update("verified")
    progress.message("line 2: error: boom")
    progress.update("error")
    progress.close()
    err = capsys.readouterr().err
    assert "verifying 1/2: verified 1, failed 0, errors 0" in err and "line 2: error: boom\n" in err
    assert err.rstrip().endswith("verifying 2/2: verified 1, failed 0, errors 1")


# --------------------------------------------------------------------------------------------
# packaging


BLOCKED = ("torch", "numpy", "sglang", "sglang_rl", "toploc", "requests", "tqdm")

_IMPORT_SCRIPT = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # any import of it raises ImportError
sys.path.insert(0, {client!r})
import sglang_rl_client, sglang_rl_client.cli, sglang_rl_client.responses, sglang_rl_client.worker_evidence
from sglang_rl_client import decode_fingerprint, from_toploc_proofs, to_toploc_proofs
fp = decode_fingerprint({fp!r})
assert from_toploc_proofs(to_toploc_proofs(fp), fp.n_rows) == fp
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r} and sys.modules[m] is not None)
print("loaded:", loaded)
sys.exit(sglang_rl_client.cli.main([{rollouts!r}, "--server", {url!r}, "--retries", "0"]))
"""


def test_the_client_runs_with_torch_numpy_sglang_and_toploc_blocked(tmp_path: Path) -> None:
    """`python -S` leaves out site-packages (and the CPU shim there that imports torch at start);
    the blocked names are poisoned in sys.modules, so importing any of them fails."""
    rollouts = write_lines(tmp_path / "r.jsonl", [rollout_line(HONEST)])
    script = _IMPORT_SCRIPT.format(blocked=BLOCKED, client=str(CLIENT_DIR), fp=fingerprint(70),
                                   rollouts=str(rollouts), url=closed_port_url())
    child = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=60)
    assert "loaded: []" in child.stdout, child.stdout + child.stderr
    assert child.returncode == cli.EXIT_ERRORS, child.stderr  # no server there: an error, not a crash
    assert '"status": "error"' in child.stdout and "cannot reach" in child.stdout


def test_the_client_builds_as_a_wheel_without_required_dependencies(tmp_path: Path) -> None:
    source = tmp_path / "client"  # a copy: building writes build/ and egg-info beside the sources
    shutil.copytree(CLIENT_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True, timeout=120)
    wheel = next(tmp_path.glob("sglang_rl_client-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith("METADATA"))).decode()
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert all("extra ==" in line for line in requires), requires
    assert "sglang-rl-verify = sglang_rl_client.cli:main" in entry_points
    assert not any(n.endswith(".so") for n in names)
    assert {f"sglang_rl_client/{m}.py" for m in ("fingerprint", "verifier", "cli", "evidence")} <= set(names)


def test_fingerprint_describe_and_sizes() -> None:
    fp = Fingerprint(128, 32, 70, (struct.pack(">129H", 65497, *([1] * 128)),) * 3)
    assert fp.num_bytes == 10 + 3 * 258 and math.ceil(70 / 32) == fp.num_chunks
    assert fp.describe() == ("v1, 70 response tokens, 3 proof(s) of 258 bytes (topk=128, 32 tokens each), "
                             "784 bytes in all")


def test_saved_responses_parse_in_every_shape() -> None:
    """The toploc-scripts' reading of saved responses (sglang_rl_client.responses)."""
    from sglang_rl_client import responses as tc

    fp = fingerprint(2)
    fields = {"input_ids": [1, 2], "output_ids": [3, 4], "toploc_verification_fingerprints": ["old", fp]}
    chat = {"model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": "hi", **fields}}]}
    completion = {"model": "m", "choices": [{"index": 0, "text": "hi", **fields}]}
    generate = [{"text": "x", "meta_info": fields}, {"text": "hi", "meta_info": fields}]
    for response, kind, choice in ((chat, "chat", 0), (completion, "completion", 0), (generate, "generate", 1)):
        gen = tc.parse_generation(response, choice)
        assert (gen.kind, gen.fingerprint, gen.input_ids, gen.output_ids, gen.text) == (kind, fp, [1, 2], [3, 4], "hi")
    request = tc.requests_for(tc.parse_generation(chat), token_endpoint=tc.GENERATE_ENDPOINT, expect_greedy=True)[0]
    assert request.body == {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 0},
                            "toploc_verification_fingerprint_to_validate": fp,
                            "toploc_verification_expect_greedy": True}
    with pytest.raises(tc.ClientError, match="covers 2 tokens but output_ids has 1"):
        tc.token_request([1], [3], fp)
    with pytest.raises(tc.ClientError, match="the fingerprint is malformed"):
        tc.parse_generation(completion) and tc.token_request([1], [3, 4], "AAAA")
