"""Servers, the HF reference and client helpers of the hidden-states end-to-end tests.

The servers come from the session's pool (e2e_servers.POOL): started once per pytest process
(ahead of the first test that needs them), shared by every test_hidden_states_*.py module (and the
others that use them; test/e2e/conftest.py imports the fixtures below), and stopped after the last
test that needs them. The first test that uses one of them also starts the Engine job.

* ``hs_server``: ``--enable-return-hidden-states --chunked-prefill-size 64 --toploc-verification``,
  radix cache on. Prompts of ~240 tokens are prefilled in 4 chunks; TOPLOC is on so that the
  concurrency test can mix fingerprinting and verification requests with hidden-state ones.
* ``hs_noradix_server``: ``--enable-return-hidden-states --disable-radix-cache``, no TOPLOC: here
  a batch of plain requests captures rows (the server flag makes every batch capture) without any
  request having raised its own capture mode, the case TOPLOC's per-request mode hides.
* ``disabled_server``: ``hs_noradix_server``'s flags with the plugin disabled, the oracle of
  the differential suite and of test_plugin_surface.
* ``refusal_server``: the plugin, no flag: ``plain_server`` of test/e2e/conftest.py.

The reference for every row is a plain transformers forward in float32:
``AutoModelForCausalLM.from_pretrained(model).model(ids).last_hidden_state`` (the lm_head input,
after the final norm), loaded once per process.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest
import requests
import torch

HERE = Path(__file__).resolve().parent
E2E_DIR = HERE.parent / "e2e"  # e2e_servers.py (and its conftest), wherever these files live
if str(E2E_DIR) not in sys.path:
    sys.path.insert(0, str(E2E_DIR))

from e2e_servers import (  # noqa: E402
    OWN_PROCESS_GROUP, Server, ServerHandle, Spec, e2e_env, ensure_random_model, free_port, server_fixture)
from sglang_rl.hidden_states import decode_rows  # noqa: E402

# A row equals the HF row when every element is within ATOL + RTOL * |HF value| (torch.allclose).
# ATOL is the 1e-4 of the spec. RTOL covers this model's outlier dimensions: dimension 199 carries
# values of |x| ~ 30-45, where sglang's own float32 forward (torch_native attention, CPU kernels)
# and transformers' differ by up to ~2e-4 at some positions (e.g. "One two three" + 5 greedy
# tokens, position 7: 1.4e-4, the same from a plain decode step as from the final-row step;
# transformers fp32 itself is 5e-5 off its own fp64 there). 1e-5 relative is float32 noise; a
# misrouted row (wrong position, wrong request, stale cache) is off by O(1).
ATOL = 1e-4
RTOL = 1e-5
TIMEOUT = 300  # per request: generous for <=100 tokens even on a loaded machine; no test waits forever
HANG_TIMEOUT = 30  # for request shapes that were seen to never answer (each answers in ~1 s when it works)
LOG_DIR = Path(os.environ.get("SGLANG_RL_TEST_LOGS", "/tmp/sglang-rl-test-logs"))

# A prompt of 236 tokens: more than 3 chunks of 64 on hs_server; greedy continues it for many tokens
# (an ending like "Summarize the list above:" makes the model stop at once, leaving no decode rows).
LONG_PROMPT = " ".join(
    f"Item {i}: the {w} river flows past the old mill."
    for i, w in enumerate(["red", "blue", "green", "quiet", "long", "cold", "wide", "dark", "slow",
                           "bright", "deep", "clear", "muddy", "small", "great", "warm", "swift"])
) + " Summarize the list above in one sentence:"
SHORT_PROMPT = "The capital of France is"


# --------------------------------------------------------------------------------------------
# shared processes

_engine_job: dict[str, Any] = {}


def _stop_engine_job() -> None:
    proc = _engine_job.get("proc")
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)  # the Engine's own group (OWN_PROCESS_GROUP): its schedulers too
        except ProcessLookupError:
            pass


atexit.register(_stop_engine_job)


def _print_stats() -> None:
    if STATS["rows"]:
        print(f"\n[hidden-states] rows compared with HF: {STATS['rows']}, max |diff| {STATS['max_abs_diff']:.3e}, "
              f"rows with some |diff| > 1e-4: {STATS['rows_over_1e-4']}", flush=True)


atexit.register(_print_stats)


# rows are compared with a transformers forward and answers with sglang alone: no real text needed
HS_RADIX = Spec("hs-radix-chunked", ("--enable-return-hidden-states", "--chunked-prefill-size", "64",
                                     "--toploc-verification"), random_weights=True)
HS_NORADIX = Spec("hs-noradix", ("--enable-return-hidden-states", "--disable-radix-cache"), random_weights=True)
# its twin without the plugin: SGLANG_PLUGINS names only the CPU stand-in's own plugin
DISABLED = Spec("disabled", HS_NORADIX.args, env={"SGLANG_PLUGINS": "sgl_kernel_cpu_standin"}, random_weights=True)


def engine_job(model_path: str) -> dict[str, Any]:
    """Start (once) `python test_hidden_states_engine.py OUT MODEL PORT` in the background: the sgl.Engine
    part of the suite, which writes its outputs to OUT with torch.save. Started when a test first
    uses a hidden-state server, so that its start overlaps the HTTP tests."""
    if not _engine_job:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        out = LOG_DIR / f"hs-engine-{os.getpid()}.pt"
        log = LOG_DIR / f"hs-engine-{os.getpid()}.log"
        if out.exists():
            out.unlink()
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **e2e_env(),
               "PYTHONPATH": os.pathsep.join([str(HERE), str(E2E_DIR), os.environ.get("PYTHONPATH", "")])}
        log_file = open(log, "w")
        # its rendezvous port from the session's ports, not picked by sglang as it starts beside other servers
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "test_hidden_states_engine.py"), str(out), model_path, str(free_port())],
            stdout=log_file, stderr=subprocess.STDOUT, env=env, **OWN_PROCESS_GROUP,
        )
        _engine_job.update(proc=proc, out=out, log=log, log_file=log_file, t0=time.time())
    return _engine_job


@pytest.fixture(scope="session")
def engine_results(random_model_path: str) -> dict:
    """What the Engine job saved (test_hidden_states_engine and test_plugin_surface read it)."""
    job = engine_job(random_model_path)
    try:
        rc = job["proc"].wait(timeout=900)
    except Exception:
        os.killpg(job["proc"].pid, 9)
        raise
    job["log_file"].close()
    log = Path(job["log"]).read_text()
    assert rc == 0, f"Engine script failed (rc {rc}), log {job['log']}:\n{log[-4000:]}"
    results = torch.load(job["out"], weights_only=False)
    print(f"\n[hidden-states] Engine subprocess: start {results['start_s']:.0f}s, total {results['total_s']:.0f}s, "
          f"waited {time.time() - job['t0']:.0f}s since launch", flush=True)
    return results


@pytest.fixture(scope="session")
def refusal_server(plain_server: Server) -> Server:
    """A server with the plugin and no --enable-return-hidden-states (conftest's `plain_server`)."""
    return plain_server


def _start_engine_job(handle: ServerHandle) -> None:
    engine_job(str(ensure_random_model()))


hs_server = server_fixture(HS_RADIX, on_use=_start_engine_job,
                           doc="--enable-return-hidden-states --chunked-prefill-size 64 --toploc-verification, "
                               "radix cache on.")
hs_noradix_server = server_fixture(HS_NORADIX, on_use=_start_engine_job,
                                   doc="--enable-return-hidden-states --disable-radix-cache.")
disabled_server = server_fixture(DISABLED, doc="sglang alone, the oracle: the plugin disabled, with the flags of "
                                                "`hs_noradix_server` (the plugin loaded, no sglang-rl flag given).")


# --------------------------------------------------------------------------------------------
# the reference


_models: dict[str, Any] = {}
_models_lock = threading.Lock()


def float32_model(model_path: str) -> Any:
    """The float32 AutoModelForCausalLM of `model_path`, loaded once per process (the hidden-state
    reference and the k-CBS oracle of kcbs_helpers read the same weights)."""
    with _models_lock:
        if model_path not in _models:
            from transformers import AutoModelForCausalLM

            torch.set_num_threads(1)
            _models[model_path] = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        return _models[model_path]


class HFReference:
    """float32 transformers forward, cached per token sequence.

    One intra-op thread: on the shared 2-core machine, with servers busy, a 2-thread OpenMP pool
    made a 240-token forward take ~15 s instead of ~1 s. A sequence that is a prefix of one already
    computed reuses its rows (causal attention: the row at p depends on tokens 0..p only)."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        torch.set_num_threads(1)
        self.model = float32_model(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.hidden = self.model.config.hidden_size
        self._cache: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.forwards = 0

    def rows(self, ids: Sequence[int]) -> torch.Tensor:
        """[len(ids), H] last_hidden_state of `ids`."""
        key = tuple(int(i) for i in ids)
        with self._lock:
            for done, rows in self._cache.items():
                if len(done) >= len(key) and done[: len(key)] == key:
                    return rows[: len(key)]
            if key not in self._cache:
                with torch.no_grad():
                    self._cache[key] = self.model.model(torch.tensor([key])).last_hidden_state[0]
                self.forwards += 1
            return self._cache[key]


_hf: dict[str, HFReference] = {}


def _reference(model_path: str) -> HFReference:
    if model_path not in _hf:
        _hf[model_path] = HFReference(model_path)
    return _hf[model_path]


@pytest.fixture(scope="session")
def hf_model(model_path: str) -> Any:
    """SmolLM2 under plain transformers in float32 (`float32_model`), for tests that run it themselves."""
    return float32_model(model_path)


@pytest.fixture(scope="session")
def hf(model_path: str) -> HFReference:
    """SmolLM2's reference (the speculative servers serve it)."""
    return _reference(model_path)


@pytest.fixture(scope="session")
def random_hf(random_model_path: str) -> HFReference:
    """The reference of the hidden-state servers' small random-weight model."""
    return _reference(random_model_path)


# --------------------------------------------------------------------------------------------
# requests


def post(url: str, path: str, body: dict, stream: bool = False) -> requests.Response:
    return requests.post(url + path, json=body, timeout=TIMEOUT, stream=stream)


def hs_fields(mode: Any = True, fmt: Optional[str] = None, scope: Optional[str] = None,
              last_n: Optional[int] = None, final: Optional[bool] = None) -> dict:
    """The request fields of one hidden-state request (None = not sent)."""
    fields: dict = {"return_hidden_states": mode}
    for key, value in (("hidden_states_format", fmt), ("hidden_states_scope", scope),
                       ("hidden_states_last_n", last_n), ("return_final_hidden_state", final)):
        if value is not None:
            fields[key] = value
    return fields


def generate(url: str, prompt: Any, max_new_tokens: int, *, temperature: float = 0.0,
             ignore_eos: bool = False, fields: Optional[dict] = None, expect: int = 200,
             **sampling: Any) -> Any:
    """/generate with input and output ids; returns the JSON (asserting the status)."""
    body: dict = {
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature,
                            "ignore_eos": ignore_eos, **sampling},
        "return_input_ids": True,
        "return_output_ids": True,
        **(fields or {}),
    }
    body["input_ids" if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else "text"] = prompt
    resp = post(url, "/generate", body)
    assert resp.status_code == expect, f"HTTP {resp.status_code}: {resp.text[:2000]}"
    return resp.json()


def stop_token(url: str, prompt: Any, max_new: int) -> int:
    """A token that ends the served model's greedy continuation of `prompt` early when stopped on:
    the first one that differs from its first token, reached before the last of `max_new` tokens
    (that first token if there is none). The random-weight model never greedily reaches its EOS
    and repeats a token for a while, then changes."""
    out = generate(url, prompt, max_new, ignore_eos=True)["meta_info"]["output_ids"]
    return next((t for t in out[1:-1] if t != out[0]), out[0])


# --------------------------------------------------------------------------------------------
# checks


def expected_positions(prompt_len: int, output_len: int, mode: Any, scope: Optional[str],
                       last_n: Optional[int], final: bool) -> list[int]:
    """The positions a request must get, written out independently of the plugin's code."""
    end = prompt_len + output_len if final else prompt_len + output_len - 1
    scope = scope or "all"
    if scope == "all":
        chosen = list(range(0, end))
    elif scope == "response":
        chosen = list(range(prompt_len, end))
    elif scope == "last_n":
        chosen = list(range(max(end - last_n, 0), end))
    else:
        raise AssertionError(scope)
    return chosen[-1:] if mode == "last" else chosen


def rows_of(fields: dict, fmt: Optional[str]) -> tuple[torch.Tensor, list[int]]:
    """Rows and positions from meta_info / an OpenAI choice / message, in the wire format."""
    assert not fields.get("hidden_states_error"), fields["hidden_states_error"]
    assert "hidden_states_rows" in fields, f"no hidden_states_rows in {sorted(fields)}"
    assert "hidden_states" not in fields, "upstream's field next to the plugin's rows"
    hs = fields["hidden_states_rows"]
    if fmt == "base64":
        assert isinstance(hs, dict) and set(hs) == {"dtype", "shape", "data", "positions"}, hs
        assert hs["dtype"] == "float32", hs["dtype"]
        rows, pos = decode_rows(hs)
        return rows, pos
    if fmt in (None, "list"):
        assert isinstance(hs, list), type(hs)
        pos = fields["hidden_states_positions"]
        assert isinstance(pos, list), pos
        rows = torch.tensor(hs, dtype=torch.float32) if hs else torch.empty(0, 0)
        return rows, pos
    if fmt == "tensor":
        assert isinstance(hs, torch.Tensor), type(hs)
        return hs, list(fields["hidden_states_positions"])
    raise AssertionError(fmt)


STATS = {"rows": 0, "max_abs_diff": 0.0, "rows_over_1e-4": 0}


def check_rows(hf: HFReference, ids: Sequence[int], rows: torch.Tensor, positions: Sequence[int],
               expected: Sequence[int], what: str = "") -> float:
    """positions == expected and every row equals the HF row at its position (ATOL/RTOL above).
    Returns the max abs diff."""
    assert list(positions) == list(expected), f"{what}: positions {list(positions)} != expected {list(expected)}"
    if not expected:
        assert rows.numel() == 0, f"{what}: rows {tuple(rows.shape)} for no positions"
        return 0.0
    assert tuple(rows.shape) == (len(expected), hf.hidden), f"{what}: shape {tuple(rows.shape)}"
    assert rows.dtype == torch.float32, f"{what}: dtype {rows.dtype}"
    ref = hf.rows(ids)[list(positions)]
    err = (rows.float() - ref).abs()
    diff = err.max().item()
    excess = err - (ATOL + RTOL * ref.abs())
    if excess.max().item() > 0:
        row, col = divmod(int(excess.argmax()), ref.shape[1])
        raise AssertionError(
            f"{what}: row at position {positions[row]} differs from HF at dim {col}: "
            f"{rows[row, col].item():.6f} vs {ref[row, col].item():.6f} (max |diff| over all rows {diff:.3e}, "
            f"allowed {ATOL} + {RTOL} * |ref|)"
        )
    STATS["rows"] += len(positions)
    STATS["max_abs_diff"] = max(STATS["max_abs_diff"], diff)
    STATS["rows_over_1e-4"] += int((err.max(dim=1).values > 1e-4).sum())
    return diff


def check_response(hf: HFReference, fields: dict, *, mode: Any, fmt: Optional[str], scope: Optional[str],
                   last_n: Optional[int] = None, final: bool = False, what: str = "") -> float:
    """One response (meta_info, OpenAI choice or message) against HF."""
    ids = list(fields["input_ids"]) + list(fields["output_ids"])
    rows, pos = rows_of(fields, fmt)
    expected = expected_positions(len(fields["input_ids"]), len(fields["output_ids"]), mode, scope, last_n, final)
    return check_rows(hf, ids, rows, pos, expected, what)


def check_rows_of_accepted_drafts(url: str, hf: HFReference, prompt: str, what: str) -> None:
    """On a speculative server: the rows of a request whose drafts get accepted (every position,
    the final token's too) equal a transformers forward of prompt + response, and asking for
    rows does not change the ids."""
    out = generate(url, prompt, 20, fields=hs_fields(True, "list", "all", None, True))
    meta = out["meta_info"]
    assert meta["spec_verify_ct"] < meta["completion_tokens"], meta
    check_response(hf, meta, mode=True, fmt="list", scope="all", last_n=None, final=True, what=what)
    assert meta["output_ids"] == generate(url, prompt, 20)["meta_info"]["output_ids"]


def finish_type(finish: Any) -> Optional[str]:
    return finish.get("type") if isinstance(finish, dict) else finish


def report(name: str, **values: Any) -> None:
    print(f"\n[hidden-states] {name}: {json.dumps(values)}", flush=True)


def assert_serving(url: str) -> None:
    """The server still answers a normal request."""
    out = generate(url, SHORT_PROMPT, 4)
    assert out["meta_info"]["output_ids"], out


def sizes(*objs: Any) -> list[int]:
    return [len(json.dumps(o, separators=(",", ":"))) for o in objs]

