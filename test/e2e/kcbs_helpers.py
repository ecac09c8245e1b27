"""Shared plumbing of the k-CBS end-to-end tests (test_kcbs_*.py; this module holds no tests).

- one real CPU server for all test_kcbs_*.py files: the suite's plain server (conftest's
  `plain_server`, the same flags; its radix cache emptied when a module takes it), started ahead
  by the pool or, in a run of one module, in the background so that the HF reference is computed
  while it boots;
- the HF oracle: `kcbs_reference` on a float32 AutoModelForCausalLM (hidden_states_fixtures'
  copy, loaded once per process), with the model's forwards
  memoised by exact token ids (the reference re-runs prompt + beam for every beam of every step,
  and cases that share a prompt share most of those forwards; the memo returns exactly what the
  model returned, so results are those of the plain reference);
- HTTP helpers and the KV-pool observable (see `pool`).

Why the oracle's EOS set is {tokenizer.eos_token_id} plus the model config's eos_token_id: the
default model is converted from GGUF and its tokenizer says eos_token = "<|im_start|>" (id 1),
while config.json / generation_config.json say eos_token_id = 2 ("<|im_end|>", the token that ends
a chat answer). sglang stops ordinary requests on both (Req.eos_token_ids from the model config,
plus the tokenizer's eos), and the k-CBS adapter finishes beams on the same set. With only
{tokenizer.eos_token_id} the oracle would keep expanding after "<|im_end|>" where the server
(correctly, like any sglang request) stops.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_servers import POOL, Server, ServerHandle  # noqa: E402

TIMEOUT = 900
LOGPROB_TOL = 1e-4

# ------------------------------------------------------------------------------------------
# prompts: plain text, and chat turns without a system prompt (short, so the oracle is cheap, and
# the model answers in a few tokens, so beams reach <|im_end|> and finished beams are carried)

TEXT_PROMPTS = {
    "capital": "The capital of France is",
    "fox": "Once upon a time, a fox",
    "count": "1, 2, 3, 4,",
    "fib": "def fibonacci(n):",
    "bread": "To bake bread, first",
    "weather": "The weather today is",
    "planet": "The largest planet in the solar system is",
    "colour": "My favourite colour is",
    "numpy": "import numpy as np\n",
    "roses": "Roses are red,",
    "sky": "The sky is blue because",
    "math": "2 + 2 =",
}
CHAT_PROMPTS = {
    "yes_no": "Reply with yes or no: is water wet?",
    "fire": "Is fire cold? Answer yes or no.",
    "earth": "Is the earth round? Reply with yes or no.",
    "fish": "Can fish swim? Yes or no?",
    "ice": "Is ice hot? Answer yes or no.",
    "snow": "Is snow white? Reply yes or no.",
    "five": "Is 5 bigger than 3? Yes or no.",
    "two_plus_two": "What is 2+2? Answer with a number only.",
    "say_hi": "Say hi.",
    "animal": "Name one animal.",
}
CHAT_TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def prompt_ids(tokenizer: Any, name: str) -> list[int]:
    if name in TEXT_PROMPTS:
        return list(tokenizer(TEXT_PROMPTS[name])["input_ids"])
    return list(tokenizer(CHAT_TURN.format(CHAT_PROMPTS[name]), add_special_tokens=False)["input_ids"])


# ------------------------------------------------------------------------------------------
# the server: the suite's plain server (no sglang-rl flag: k-CBS is asked for per request)

KCBS_SERVER = "plain"  # the pool's key of conftest's `plain_server`


def start_server_ahead() -> None:
    """Start the server in the background now if it is not started yet (the pool normally has
    started it ahead already), so that the caller computes its references while it boots."""
    POOL.ensure_started(KCBS_SERVER)


def shared_server() -> ServerHandle:
    """The server, its radix cache emptied (earlier modules used it too: the k-CBS modules start
    from what a fresh server has cached)."""
    server = ServerHandle(KCBS_SERVER)
    flush_cache(server.url)
    return server


# ------------------------------------------------------------------------------------------
# the HF oracle


class _MemoLm:
    """Callable stand-in for the HF model that replays forwards it has already run on the same
    ids (the reference calls model(ids, logits_to_keep=1, use_cache=False))."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: dict[tuple, Any] = {}
        self.calls = 0
        self.misses = 0
        self._lock = threading.Lock()

    def parameters(self):
        return self.model.parameters()

    def __call__(self, input_ids: Any, **kwargs: Any) -> Any:
        key = (repr(sorted(kwargs.items())), *input_ids.flatten().tolist())
        with self._lock:
            self.calls += 1
            if key not in self.cache:
                self.misses += 1
                self.cache[key] = self.model(input_ids, **kwargs)
            return self.cache[key]


_lock = threading.Lock()
_oracle: dict[str, dict] = {}


def oracle(model_path: str) -> dict:
    """{"model": memoised float32 HF model, "tokenizer", "eos": set of EOS ids} of `model_path`
    (loaded once per model)."""
    with _lock:
        if model_path not in _oracle:
            import torch
            from transformers import AutoTokenizer

            from hidden_states_fixtures import float32_model

            torch.set_num_threads(1)  # tiny forwards on a busy shared CPU: one thread is fastest
            tokenizer = AutoTokenizer.from_pretrained(model_path)
            model = float32_model(model_path)  # one copy per process, the hidden-state reference's too
            eos = {int(tokenizer.eos_token_id)}
            config_eos = model.config.eos_token_id
            gen_eos = getattr(model.generation_config, "eos_token_id", None)
            for value in (config_eos, gen_eos):
                if value is not None:
                    eos |= set(value) if isinstance(value, (list, tuple)) else {int(value)}
            _oracle[model_path] = {"model": _MemoLm(model), "tokenizer": tokenizer, "eos": eos}
        return _oracle[model_path]


def reference(model_path: str, ids: list[int], k: int, steps: int, final_prune: bool) -> list[dict]:
    """kcbs_reference's candidates as dicts shaped like the server's."""
    from sglang_rl.kcbs.reference import kcbs_reference

    o = oracle(model_path)
    cands = kcbs_reference(o["model"], list(ids), k, steps, final_prune, o["eos"])
    return [
        {"token_ids": list(c.token_ids), "logprob": c.logprob, "raw_logprob": c.raw_logprob,
         "finish_reason": c.finish_reason}
        for c in cands
    ]


def assert_candidates_match(got: list[dict], want: list[dict], label: str, tol: float = LOGPROB_TOL,
                            got_name: str = "server", want_name: str = "reference") -> None:
    """Same token lists in the same order, log-probs within tol, same finish reasons."""
    got_tokens = [c["token_ids"] for c in got]
    want_tokens = [c["token_ids"] for c in want]
    assert got_tokens == want_tokens, (
        f"{label}: candidates differ\n {got_name + ':':<10} {_brief(got)}\n {want_name + ':':<10} {_brief(want)}"
    )
    for i, (g, w) in enumerate(zip(got, want)):
        for key in ("logprob", "raw_logprob"):
            assert abs(g[key] - w[key]) <= tol, f"{label}: candidate {i} {key} {g[key]} vs {w[key]}"
        assert g["finish_reason"] == w["finish_reason"], (
            f"{label}: candidate {i} finish_reason {g['finish_reason']!r} vs {w['finish_reason']!r}"
        )


def _brief(cands: list[dict]) -> str:
    return json.dumps([[c["token_ids"], round(c["logprob"], 5), c["finish_reason"]] for c in cands])


# ------------------------------------------------------------------------------------------
# HTTP


def post(url: str, path: str, body: dict, timeout: float = TIMEOUT, stream: bool = False) -> requests.Response:
    return requests.post(url + path, json=body, timeout=timeout, stream=stream)


def generate(url: str, body: dict) -> dict:
    resp = post(url, "/generate", body)
    assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:500]}"
    return resp.json()


def kcbs_body(ids: list[int], k: Optional[int], steps: Optional[int], final_prune: Optional[bool],
              max_new_tokens: Optional[int] = None) -> dict:
    body: dict = {"input_ids": list(ids),
                  "sampling_params": {"max_new_tokens": max_new_tokens if max_new_tokens is not None else steps},
                  "kcbs_enabled": True}
    if k is not None:
        body["kcbs_beam_width"] = k
    if steps is not None:
        body["kcbs_steps"] = steps
    if final_prune is not None:
        body["kcbs_final_prune"] = final_prune
    return body


def greedy_body(ids: list[int], max_new_tokens: int, stream: bool = False) -> dict:
    return {"input_ids": list(ids), "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "stream": stream}


def stream_generate(url: str, body: dict) -> dict:
    """A streaming /generate; returns the last event (cumulative text and output_ids)."""
    resp = post(url, "/generate", {**body, "stream": True}, stream=True)
    assert resp.status_code == 200, resp.text[:500]
    last = None
    events = 0
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            event = json.loads(line[len(b"data: "):])
            assert "error" not in event, event
            last = event
            events += 1
    assert last is not None and last["meta_info"]["finish_reason"] is not None, last
    last["_events"] = events
    return last


def flush_cache(url: str) -> None:
    """Empty the radix cache (between tests whose results are compared, so that one test's
    cached prefixes cannot change another test's results)."""
    import time

    deadline = time.time() + 120
    while True:  # sglang refuses to flush while requests run (e.g. an earlier test's aborts settling)
        resp = requests.post(url + "/flush_cache", timeout=120)
        if resp.status_code == 200 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert resp.status_code == 200, resp.text


def pmap(fn: Callable, items: Iterable, workers: int = 8) -> list:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


# ------------------------------------------------------------------------------------------
# KV pool observable


def pool(url: str) -> dict:
    """The scheduler's load snapshot from GET /v1/loads (sglang 0.5.17).

    `num_used_tokens` is max_total_num_tokens - (free slots of the KV allocator + evictable
    tokens of the radix cache): KV slots held by running requests, locked radix nodes, or leaked.
    Cached prefixes that nothing references are evictable and so count as free, which is what
    makes it comparable before/after without /flush_cache (flushing would reset the allocator
    wholesale and so hide a leak rather than reveal it). The scheduler publishes the snapshot
    every 15 busy iterations and on every idle iteration, so once the server is idle the value is
    current; `total_prefill_uncached_tokens` (a monotone counter of computed prefill tokens) tells
    whether the server is still doing work. sglang's own idle check
    (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, on by default) additionally kills the scheduler if
    free + evictable + locked does not add up to the pool size, which the health checks would see.
    """
    resp = requests.get(url + "/v1/loads", params={"include": "core,queues"}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["loads"][0]


def work_done(snap: dict) -> int:
    """Rows the server has computed so far: prefill tokens plus decode rows (the second of
    sglang's decode moments is the running sum of decode batch sizes). k-CBS beams after their
    one-token extend are decode rows, so an abandoned search shows up in the second term."""
    moments = snap.get("decode_moments") or [0, 0]
    return int(snap["total_prefill_uncached_tokens"] + moments[1])


def wait_idle(url: str, timeout: float, quiet_s: float = 3.0, baseline: Optional[int] = None) -> tuple[bool, dict, list]:
    """Poll until no work (`work_done`) happened for `quiet_s` seconds and nothing waits or runs
    (and, if given, num_used_tokens == baseline). Returns (reached, last snapshot, trace of
    snapshots)."""
    deadline = time.time() + timeout
    trace: list = []
    last_work = None
    quiet_since = time.time()
    snap = pool(url)
    while True:
        work = work_done(snap)
        if work != last_work:
            last_work = work
            quiet_since = time.time()
        trace.append((round(time.time(), 2), snap["num_used_tokens"], snap["num_waiting_reqs"], work))
        settled = (
            snap["num_waiting_reqs"] == 0
            and snap.get("num_running_reqs", 0) == 0
            and time.time() - quiet_since >= quiet_s
            and (baseline is None or snap["num_used_tokens"] == baseline)
        )
        if settled:
            return True, snap, trace
        if time.time() > deadline:
            return False, snap, trace
        time.sleep(0.5)
        snap = pool(url)


def server_log_tail(server: Server, chars: int = 3000) -> str:
    try:
        return server.log_path.read_text()[-chars:]
    except OSError:
        return ""
