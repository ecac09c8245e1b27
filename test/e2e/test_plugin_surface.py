"""The plugin's surface in real sglang: CLI flags, sgl.Engine kwargs, and no trace when unused.

- `python -m sglang.launch_server --help` lists the --toploc-verification* flags;
- `sglang.Engine(..., toploc_verification=True)` takes the flag as a kwarg, and
  `engine.generate(..., return_output_ids=True)` returns fingerprints in meta_info, which verify
  through the Engine too (run in a subprocess script: plugins patch sglang process-wide);
- a server with the plugin disabled (`disabled_server`: SGLANG_PLUGINS names only the CPU
  stand-in's plugin) and a server with the plugin loaded but no sglang-rl flag
  (`hs_noradix_server`, the same flags) give the same greedy text and the same response fields,
  none of them sglang-rl's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from e2e_servers import POOL, e2e_env
from hidden_states_fixtures import DISABLED
from sglang_rl.fingerprint import decode_fingerprint
from toploc_helpers import RL_FIELDS, gen_generate, pmap, post, record, verify_tokens

FLAGS = (
    "--toploc-verification",
    "--toploc-verification-topk",
    "--toploc-verification-max-exp-mismatches",
    "--toploc-verification-max-mant-err-mean",
    "--toploc-verification-max-mant-err-median",
)

ENGINE_SCRIPT = textwrap.dedent('''
    import json
    import sys


    def main(model: str) -> None:
        import sglang

        engine = sglang.Engine(model_path=model, device="cpu", attention_backend="torch_native",
                               dtype="float32", max_total_tokens=8192, toploc_verification=True,
                               log_level="warning")
        result = {}
        try:
            params = {"max_new_tokens": 8, "temperature": 0}
            # the documented call: sampling params passed positionally, sglang-rl fields as kwargs
            try:
                out = engine.generate("The capital of France is", params, return_output_ids=True)
                result["positional"] = {"ok": True, "meta": out["meta_info"], "text": out["text"]}
            except Exception as exc:  # recorded for the test to assert on
                result["positional"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            # the same request with every argument by keyword
            out = engine.generate(prompt="The capital of France is", sampling_params=params,
                                  return_output_ids=True, return_input_ids=True)
            meta = out["meta_info"]
            result["keyword"] = {"meta": meta, "text": out["text"]}
            fp = meta["toploc_verification_fingerprints"][-1]
            check = engine.generate(input_ids=meta["input_ids"] + meta["output_ids"],
                                    sampling_params={"max_new_tokens": 0},
                                    toploc_verification_fingerprint_to_validate=fp,
                                    toploc_verification_expect_greedy=True)
            result["verification"] = check["meta_info"]
            # a batch: each prompt's own fingerprint as a per-item kwarg list (lengths differ)
            outs = engine.generate(["Name a color:", "Count to five:", "Hello"],
                                   [{"max_new_tokens": n, "temperature": 0} for n in (3, 9, 6)],
                                   return_input_ids=True, return_output_ids=True)
            batch = engine.generate(
                input_ids=[o["meta_info"]["input_ids"] + o["meta_info"]["output_ids"] for o in outs],
                sampling_params={"max_new_tokens": 0},
                toploc_verification_fingerprint_to_validate=[
                    o["meta_info"]["toploc_verification_fingerprints"][-1] for o in outs])
            result["batch_verification"] = [b["meta_info"] for b in batch]
        finally:
            print("RESULT " + json.dumps(result), flush=True)
            engine.shutdown()


    if __name__ == "__main__":
        main(sys.argv[1])
''')

PROMPTS = ("The capital of France is", "def square(x):", "Once upon a time",
           "List three colors:")


def _env(extra: dict | None = None) -> dict:
    return {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **e2e_env(extra)}


@pytest.fixture(scope="module")
def launched(model_path, tmp_path_factory) -> dict:
    """Help texts and the Engine script run as subprocesses (while the disabled server starts, if
    the pool has not started it ahead)."""
    tmp = tmp_path_factory.mktemp("surface")
    script = tmp / "engine_script.py"
    script.write_text(ENGINE_SCRIPT)
    procs = {
        "help": subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--help"], env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        "engine": subprocess.Popen([sys.executable, str(script), model_path], env=_env(), cwd=str(tmp),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }
    try:
        POOL.ensure_started(DISABLED.key)
        outputs = {}
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=900)
            outputs[name] = (proc.returncode, out)
        yield {"outputs": outputs}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def test_help_lists_the_flags(launched) -> None:
    code, out = launched["outputs"]["help"]
    assert code == 0, out[-2000:]
    missing = [flag for flag in FLAGS if flag not in out]
    assert not missing, missing
    assert "--max-total-tokens" in out  # sglang's own flags are still there


def _engine_result(launched) -> dict:
    code, out = launched["outputs"]["engine"]
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_engine_generate_with_positional_sampling_params(launched) -> None:
    """`engine.generate(prompt, sampling_params, return_output_ids=True)`: sglang's own
    signature takes sampling_params positionally; the plugin's kwargs must not break that."""
    positional = _engine_result(launched).get("positional")
    assert positional is not None
    assert positional["ok"], f"Engine.generate(prompt, params, return_output_ids=True) raised: {positional}"
    meta = positional["meta"]
    assert decode_fingerprint(meta["toploc_verification_fingerprints"][-1]).n_rows == len(meta["output_ids"])


def test_engine_takes_the_flag_and_returns_fingerprints(launched, toploc_server) -> None:
    code, out = launched["outputs"]["engine"]
    result = _engine_result(launched)
    assert code == 0 and "keyword" in result and "verification" in result, out[-3000:]
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
    # the Engine and the server compute the same greedy tokens, and the server verifies the
    # Engine's fingerprint
    [server] = gen_generate(toploc_server.url, text="The capital of France is", max_tokens=8, temperature=0.0)
    assert server["output_ids"] == meta["output_ids"]
    assert server["input_ids"] == meta["input_ids"]
    status, cross = verify_tokens(toploc_server.url, meta["input_ids"] + meta["output_ids"], fps[-1])
    assert status == 200 and cross["verified"] is True, cross


def test_engine_batch_verification_per_item(launched) -> None:
    """Engine.generate with a list of prompts and a per-item list of fingerprints: each item is
    verified against its own (the responses have 3, 9 and 6 tokens)."""
    result = _engine_result(launched)
    assert "batch_verification" in result, launched["outputs"]["engine"][1][-3000:]
    reports = [json.loads(meta_result(m)) for m in result["batch_verification"]]
    assert [r["verified"] for r in reports] == [True, True, True], reports
    assert [r["response_tokens"] for r in reports] == [3, 9, 6]


def meta_result(meta: dict) -> str:
    value = meta.get("toploc_verification_fingerprint_validation_result")
    assert isinstance(value, str), meta
    return value


def _no_rl_fields(obj: object, where: str) -> None:
    text = json.dumps(obj)
    assert "toploc" not in text, (where, text[:500])
    if isinstance(obj, dict) and "meta_info" in obj:
        assert not set(RL_FIELDS) & set(obj["meta_info"]), (where, obj["meta_info"].keys())


def _collect(url: str) -> list[dict]:
    def one(prompt: str) -> dict:
        gen = post(url, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
        comp = post(url, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 12,
                                              "temperature": 0})
        chat = post(url, "/v1/chat/completions", {"model": "default", "max_tokens": 12, "temperature": 0,
                                                   "messages": [{"role": "user", "content": prompt}]})
        for resp in (gen, comp, chat):
            assert resp.status_code == 200, resp.text
        return {"generate": gen.json(), "completions": comp.json(), "chat": chat.json()}

    return pmap(one, PROMPTS, workers=4)


def test_disabled_plugin_and_unflagged_plugin_answer_the_same(disabled_server, hs_noradix_server) -> None:
    with_plugin, without_plugin = _collect(hs_noradix_server.url), _collect(disabled_server.url)
    for prompt, a, b in zip(PROMPTS, with_plugin, without_plugin):
        for kind in ("generate", "completions", "chat"):
            _no_rl_fields(a[kind], f"plugin loaded, {kind}")
            _no_rl_fields(b[kind], f"plugin disabled, {kind}")
        assert a["generate"]["text"] == b["generate"]["text"], prompt
        assert a["generate"]["output_ids"] == b["generate"]["output_ids"], prompt
        assert set(a["generate"]["meta_info"]) == set(b["generate"]["meta_info"]), prompt
        assert set(a["generate"]) == set(b["generate"]), prompt
        assert a["completions"]["choices"][0]["text"] == b["completions"]["choices"][0]["text"]
        assert set(a["completions"]["choices"][0]) == set(b["completions"]["choices"][0])
        assert a["chat"]["choices"][0]["message"] == b["chat"]["choices"][0]["message"]
        assert set(a["chat"]["choices"][0]) == set(b["chat"]["choices"][0])
    record("plugin_disabled_vs_unflagged", prompts=len(PROMPTS),
           texts=[a["generate"]["text"] for a in with_plugin])


def test_plugin_is_really_loaded_on_one_and_not_the_other(disabled_server, hs_noradix_server) -> None:
    """return_output_ids is served by the plugin even without --toploc-verification; the disabled
    server does not know the field (so the comparison above compares the two situations)."""
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_output_ids": True}
    loaded = post(hs_noradix_server.url, "/generate", body)
    assert loaded.status_code == 200 and len(loaded.json()["meta_info"]["output_ids"]) == 3
    assert "toploc_verification_fingerprints" not in loaded.json()["meta_info"]
    off = post(disabled_server.url, "/generate", body)
    assert off.status_code != 200 or "output_ids" not in off.json()["meta_info"], off.text[:300]
