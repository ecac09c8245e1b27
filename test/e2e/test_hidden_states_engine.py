"""Hidden states through the in-process sgl.Engine: format "tensor" (Engine only), base64 and list,
every scope and mode, radix cache repeats, 64-token chunked prefill, batched prompts, async, and
ValueErrors for bad fields.

The Engine runs in a subprocess: this file run as a script (`python test_hidden_states_engine.py
OUT MODEL`, the __main__ guard below) starts sgl.Engine on the CPU, makes the requests and
torch.saves what came back; the test compares it with the HF forward. The subprocess is started in
the background as soon as the first hidden-states fixture is requested (hidden_states_fixtures.
engine_job), so it overlaps the HTTP servers' start. The Engine has TOPLOC on (as hs_server) and
also makes test_plugin_surface's Engine calls (`_surface_calls`): one Engine start for both.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from hidden_states_fixtures import check_response, report

HERE = Path(__file__).resolve().parent


# (name, prompt kind, max_new_tokens, kwargs)
def _requests(long_prompt: str, short_prompt: str) -> list[tuple[str, str, int, dict]]:
    reqs = []
    for mode in (True, "last"):
        for scope, last_n in (("all", None), ("response", None), ("last_n", 9)):
            final = (mode is True) == (scope != "response")
            kw = {"return_hidden_states": mode, "hidden_states_format": "tensor", "hidden_states_scope": scope,
                  "return_final_hidden_state": final}
            if last_n is not None:
                kw["hidden_states_last_n"] = last_n
            reqs.append((f"tensor {mode} {scope} final={final}", long_prompt, 6, kw))
    reqs.append(("tensor all again (cached prompt)", long_prompt, 6,
                 {"return_hidden_states": True, "hidden_states_format": "tensor"}))
    reqs.append(("base64 response final", long_prompt, 6,
                 {"return_hidden_states": True, "hidden_states_format": "base64", "hidden_states_scope": "response",
                  "return_final_hidden_state": True}))
    reqs.append(("list last_n=3", short_prompt, 8,
                 {"return_hidden_states": True, "hidden_states_format": "list", "hidden_states_scope": "last_n",
                  "hidden_states_last_n": 3}))
    return reqs


def _engine_main(out_path: str, model_path: str, nccl_port: str) -> None:

    import sglang as sgl

    from hidden_states_fixtures import LONG_PROMPT, SHORT_PROMPT

    t0 = time.time()
    engine = sgl.Engine(model_path=model_path, device="cpu", attention_backend="torch_native", dtype="float32",
                        max_total_tokens=16384, enable_return_hidden_states=True, chunked_prefill_size=64,
                        toploc_verification=True, log_level="warning", nccl_port=int(nccl_port))
    started = time.time() - t0
    print(f"[engine] started in {started:.0f}s", flush=True)
    ids = {"return_input_ids": True, "return_output_ids": True}
    greedy = {"temperature": 0.0}
    records = []

    def keep(name, kw, out):
        print(f"[engine] {time.time() - t0:.0f}s {name}", flush=True)
        meta = out["meta_info"]
        records.append({"name": name, "kw": kw, "text": out["text"],
                        **{k: meta.get(k) for k in ("input_ids", "output_ids", "hidden_states_rows",
                                                    "hidden_states_positions", "hidden_states_error")}})

    try:
        engine.generate(prompt=LONG_PROMPT, sampling_params={"max_new_tokens": 4, **greedy})  # cache it
        for name, prompt, max_new, kw in _requests(LONG_PROMPT, SHORT_PROMPT):
            out = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": max_new, **greedy}, **ids, **kw)
            keep(name, kw, out)
        # token-id input, batched prompts
        kw = {"return_hidden_states": True, "hidden_states_format": "tensor", "hidden_states_scope": "response",
              "return_final_hidden_state": True}
        outs = engine.generate(prompt=[SHORT_PROMPT, "One two three", "A short poem about the sea:"],
                               sampling_params={"max_new_tokens": 5, **greedy}, **ids, **kw)
        for i, out in enumerate(outs):
            keep(f"batch item {i}", kw, out)
        kw = {"return_hidden_states": True, "hidden_states_format": "tensor", "hidden_states_scope": "all"}
        out = engine.generate(input_ids=[504, 3575, 282, 4649, 314], sampling_params={"max_new_tokens": 5, **greedy},
                              **ids, **kw)
        keep("input_ids prompt", kw, out)
        kw = {"return_hidden_states": "last", "hidden_states_format": "tensor", "hidden_states_scope": "all",
              "return_final_hidden_state": True}
        # on the Engine's own loop: its tokenizer manager receives results there (asyncio.run would
        # start a second loop that nothing answers)
        out = engine.loop.run_until_complete(engine.async_generate(prompt=SHORT_PROMPT,
                                                sampling_params={"max_new_tokens": 7, **greedy}, **ids, **kw))
        keep("async_generate", kw, out)
        errors = {}
        for name, bad in (("xml", {"hidden_states_format": "xml"}),
                          ("last_n=0", {"hidden_states_scope": "last_n", "hidden_states_last_n": 0}),
                          ("last_n without scope", {"hidden_states_last_n": 2})):
            try:
                engine.generate(prompt=SHORT_PROMPT, sampling_params={"max_new_tokens": 2},
                                return_hidden_states=True, **bad)
                errors[name] = None
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on by the test
                errors[name] = f"{type(exc).__name__}: {exc}"
        after = engine.generate(prompt=SHORT_PROMPT, sampling_params={"max_new_tokens": 3, **greedy}, **ids,
                                return_hidden_states=True, hidden_states_format="tensor")
        keep("after errors", {"return_hidden_states": True, "hidden_states_format": "tensor"}, after)
        surface = _surface_calls(engine)
    finally:
        engine.shutdown()
    torch.save({"records": records, "errors": errors, "surface": surface, "start_s": started,
                "total_s": time.time() - t0}, out_path)


def _surface_calls(engine) -> dict:
    """test_plugin_surface's Engine calls: fingerprints from `generate`, verified by the Engine."""
    result = {}
    params = {"max_new_tokens": 8, "temperature": 0}
    # the documented call: sampling params passed positionally, sglang-rl fields as kwargs
    try:
        out = engine.generate("The capital of France is", params, return_output_ids=True)
        result["positional"] = {"ok": True, "meta": out["meta_info"], "text": out["text"]}
    except Exception as exc:  # noqa: BLE001 - recorded for the test to assert on
        result["positional"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    # the same request with every argument by keyword
    out = engine.generate(prompt="The capital of France is", sampling_params=params,
                          return_output_ids=True, return_input_ids=True)
    meta = out["meta_info"]
    result["keyword"] = {"meta": meta, "text": out["text"]}
    fp = meta["toploc_verification_fingerprints"][-1]
    check = engine.generate(input_ids=meta["input_ids"] + meta["output_ids"], sampling_params={"max_new_tokens": 0},
                            toploc_verification_fingerprint_to_validate=fp, toploc_verification_expect_greedy=True)
    result["verification"] = check["meta_info"]
    # a batch: each prompt's own fingerprint as a per-item kwarg list (lengths differ)
    outs = engine.generate(["Name a color:", "Count to five:", "Hello"],
                           [{"max_new_tokens": n, "temperature": 0} for n in (3, 9, 6)],
                           return_input_ids=True, return_output_ids=True)
    batch = engine.generate(
        input_ids=[o["meta_info"]["input_ids"] + o["meta_info"]["output_ids"] for o in outs],
        sampling_params={"max_new_tokens": 0},
        toploc_verification_fingerprint_to_validate=[o["meta_info"]["toploc_verification_fingerprints"][-1]
                                                     for o in outs])
    result["batch_verification"] = [b["meta_info"] for b in batch]
    return result


def test_engine_rows_match_hf(engine_results, random_hf) -> None:
    records = engine_results["records"]
    assert len(records) == 9 + 3 + 1 + 1 + 1, [r["name"] for r in records]
    diffs = {}
    for rec in records:
        kw = rec["kw"]
        fmt = kw.get("hidden_states_format")
        if fmt == "tensor":
            assert isinstance(rec["hidden_states_rows"], torch.Tensor), (rec["name"], type(rec["hidden_states_rows"]))
        diffs[rec["name"]] = check_response(
            random_hf, rec, mode=kw["return_hidden_states"], fmt=fmt, scope=kw.get("hidden_states_scope"),
            last_n=kw.get("hidden_states_last_n"), final=bool(kw.get("return_final_hidden_state")),
            what=f"Engine {rec['name']}")
    cached = next(r for r in records if r["name"] == "tensor all again (cached prompt)")
    assert cached["hidden_states_positions"][0] == 0 and len(cached["input_ids"]) > 3 * 64
    report("Engine", **{k: f"{v:.1e}" for k, v in diffs.items()})


def test_engine_bad_fields_raise(engine_results) -> None:
    errors = engine_results["errors"]
    assert errors["xml"] and "hidden_states_format" in errors["xml"], errors
    assert errors["last_n=0"] and "positive" in errors["last_n=0"], errors
    assert errors["last_n without scope"] and "last_n" in errors["last_n without scope"], errors


if __name__ == "__main__":
    _engine_main(sys.argv[1], sys.argv[2], sys.argv[3])
