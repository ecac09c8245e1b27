"""The plugin's surface in real sglang: CLI flags, sgl.Engine kwargs, and no trace when unused.

- `python -m sglang.launch_server --help` lists the --toploc-verification* flags;
- `sglang.Engine(..., toploc_verification=True)` takes the flag as a kwarg, and
  `engine.generate(..., return_output_ids=True)` returns fingerprints in meta_info, which verify
  through the Engine too (in the hidden-states Engine job's subprocess, `engine_results`: plugins
  patch sglang process-wide, and one Engine start serves both modules);
- a server with the plugin loaded but no sglang-rl flag (`hs_noradix_server`) serves the plugin's
  fields, and one with the plugin disabled (`disabled_server`: SGLANG_PLUGINS names only the CPU
  stand-in's plugin, the same flags) does not know them. That the two answer sglang's own requests
  the same, field for field: test_upstream_differential.py (its `plugin` server).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from e2e_servers import POOL, e2e_env
from hidden_states_fixtures import DISABLED, engine_job
from sglang_rl.fingerprint import decode_fingerprint
from toploc_helpers import gen_generate, post, record, verify_tokens

FLAGS = (
    "--toploc-verification",
    "--toploc-verification-topk",
    "--toploc-verification-max-exp-mismatches",
    "--toploc-verification-max-mant-err-mean",
    "--toploc-verification-max-mant-err-median",
)


def _env(extra: dict | None = None) -> dict:
    return {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **e2e_env(extra)}


@pytest.fixture(scope="module")
def launched(random_model_path) -> dict:
    """The help text, from a subprocess (while the disabled server and the Engine job start, if
    nothing started them ahead)."""
    engine_job(random_model_path)
    proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--help"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        POOL.ensure_started(DISABLED.key)
        out, _ = proc.communicate(timeout=900)
        yield {"help": (proc.returncode, out)}
    finally:
        if proc.poll() is None:
            proc.kill()


def test_help_lists_the_flags(launched) -> None:
    code, out = launched["help"]
    assert code == 0, out[-2000:]
    missing = [flag for flag in FLAGS if flag not in out]
    assert not missing, missing
    assert "--max-total-tokens" in out  # sglang's own flags are still there


def _engine_result(engine_results) -> dict:
    assert "surface" in engine_results, sorted(engine_results)
    return engine_results["surface"]


def test_engine_generate_with_positional_sampling_params(engine_results) -> None:
    """`engine.generate(prompt, sampling_params, return_output_ids=True)`: sglang's own
    signature takes sampling_params positionally; the plugin's kwargs must not break that."""
    positional = _engine_result(engine_results).get("positional")
    assert positional is not None
    assert positional["ok"], f"Engine.generate(prompt, params, return_output_ids=True) raised: {positional}"
    meta = positional["meta"]
    assert decode_fingerprint(meta["toploc_verification_fingerprints"][-1]).n_rows == len(meta["output_ids"])


def test_engine_takes_the_flag_and_returns_fingerprints(engine_results, hs_server) -> None:
    result = _engine_result(engine_results)
    assert "keyword" in result and "verification" in result, sorted(result)
    meta = result["keyword"]["meta"]
    fps = meta["toploc_verification_fingerprints"]
    assert isinstance(fps, list) and len(fps) >= 1
    fp = decode_fingerprint(fps[-1], expected_topk=128)
    assert fp.n_rows == len(meta["output_ids"]) == meta["completion_tokens"]
    assert fp.num_chunks == 1
    report = json.loads(meta_result(result["verification"]))
    record("engine_surface", text=result["keyword"]["text"], n_rows=fp.n_rows, verified=report["verified"],
           greedy_consistent=report.get("greedy_consistent"),
           positional_call=result.get("positional", {}).get("error", "ok"))
    assert report["verified"] is True and report["greedy_consistent"] is True
    # the Engine and a TOPLOC server of the same model compute the same greedy tokens, and the
    # server verifies the Engine's fingerprint
    [server] = gen_generate(hs_server.url, text="The capital of France is", max_tokens=8, temperature=0.0)
    assert server["output_ids"] == meta["output_ids"]
    assert server["input_ids"] == meta["input_ids"]
    status, cross = verify_tokens(hs_server.url, meta["input_ids"] + meta["output_ids"], fps[-1])
    assert status == 200 and cross["verified"] is True, cross


def test_engine_batch_verification_per_item(engine_results) -> None:
    """Engine.generate with a list of prompts and a per-item list of fingerprints: each item is
    verified against its own (the responses have 3, 9 and 6 tokens)."""
    result = _engine_result(engine_results)
    assert "batch_verification" in result, sorted(result)
    reports = [json.loads(meta_result(m)) for m in result["batch_verification"]]
    assert [r["verified"] for r in reports] == [True, True, True], reports
    assert [r["response_tokens"] for r in reports] == [3, 9, 6]


def meta_result(meta: dict) -> str:
    value = meta.get("toploc_verification_fingerprint_validation_result")
    assert isinstance(value, str), meta
    return value


def test_plugin_is_really_loaded_on_one_and_not_the_other(disabled_server, hs_noradix_server) -> None:
    """return_output_ids is served by the plugin even without --toploc-verification; the disabled
    server does not know the field (so the differential suite compares the two situations)."""
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_output_ids": True}
    loaded = post(hs_noradix_server.url, "/generate", body)
    assert loaded.status_code == 200 and len(loaded.json()["meta_info"]["output_ids"]) == 3
    assert "toploc_verification_fingerprints" not in loaded.json()["meta_info"]
    off = post(disabled_server.url, "/generate", body)
    assert off.status_code != 200 or "output_ids" not in off.json()["meta_info"], off.text[:300]
