"""Load and soak test of one CPU server with every sglang-rl feature on: `make soak`.

Starts one server (TOPLOC, hidden states, radix cache, 64-token chunked prefill), warms it up with
every request kind, and records its idle state. Then:

1. a burst: `--burst` mixed requests sent at once;
2. a soak: `--concurrency` clients, each sending one request after another for `--soak-seconds`.

The mix: OpenAI chat and completions, `/generate`, streamed chat and completions, hidden-state
rows (base64 and list, every scope, with and without the final row), k-CBS, verification of
earlier responses, hostile fingerprints, and client disconnects (streams closed after their first
chunk; requests whose client gives up after 0.05-1.5 s). Every generation that carries a
fingerprint is verified at once by a follow-up request in the exact-token form.

Checks (exit 1 if any fails): no 5xx; no request lost (no answer, and not an intended
disconnect); every 4xx is an intended hostile input and every hostile input gets a 4xx; every
fingerprint verifies against its own tokens; every answer has the fields it asked for. Once idle
after the burst and after the soak: no request running or waiting and no KV token in use, the
server's row files in /dev/shm and its thread counts back to the warm-up level, and its RSS
within the tolerance of `--rss-tolerance` (see `rss_limit`). Prints one summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import httpx
import psutil
import requests

from load_common import FP_IN, FP_OUT, RESULT, Server, hostile_fingerprints, honest_sample, start_feature_server

from sglang_rl.hidden_states import decode_rows_numpy
from sglang_rl.hidden_states.row_segments import shm_dir

TIMEOUT = 600.0  # an answer later than this counts as lost
TOPLOC_THREADS = "sglang-rl-toploc"  # thread_name_prefix of the proof workers (adapters/toploc.py)
# counted in the server log: tracebacks and sglang's idle memory-leak check fail the run; the
# others are what disconnects and hostile inputs are expected to log
LOG_PATTERNS = ("Traceback", "leak", "disconnected from the client", "but the state was deleted", "invalid toploc")
LOOP_POOLS = ("uvloop", "asyncio")  # names of the event loop's default executor threads
LOOP_POOL_BOUND = min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's default max_workers
SERVER_ARGS = ("--chunked-prefill-size", "64")
PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea.",
    "List three colors of the rainbow:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Count: one, two, three,",
    "Explain in a few words why the sky is blue.",
    "A short note on bees, number 3:",
    " ".join(f"Item {i}: the {w} river flows past the old mill." for i, w in
             enumerate(["red", "blue", "green", "quiet", "long", "cold", "wide", "dark"])) + " Summarize:",
]


@dataclass
class Run:
    """Shared state of one load phase: the client, counts, failures, recent honest material."""

    url: str
    client: httpx.AsyncClient
    rng: random.Random
    material: deque
    counts: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)

    def fail(self, what: str, detail: Any) -> None:
        self.counts["failures"] += 1
        if len(self.failures) < 40:
            self.failures.append(f"{what}: {str(detail)[:700]}")


@dataclass
class Answer:
    status: int
    body: Any  # parsed JSON, the list of SSE events, or text


# ------------------------------------------------------------------------------------------------
# sending and counting


async def send(run: Run, kind: str, path: str, body: dict, *, stream: bool = False, hostile: bool = False,
               cut_after_first: bool = False, give_up_after: Optional[float] = None) -> Optional[Answer]:
    """Send one request and count its outcome; None when there is no answer to look at."""
    run.counts["sent"] += 1
    run.counts[f"sent:{kind}"] += 1
    if hostile:
        run.counts["hostile_sent"] += 1
    timeout = httpx.Timeout(TIMEOUT if give_up_after is None else give_up_after, connect=30.0)
    try:
        if stream:
            answer = await _stream(run, path, body, timeout, cut_after_first)
            if answer is None:
                run.counts["disconnected"] += 1
                return None
        else:
            resp = await run.client.post(run.url + path, json=body, timeout=timeout)
            answer = Answer(resp.status_code, resp.json() if resp.status_code == 200 else resp.text)
    except httpx.TimeoutException:
        if give_up_after is not None:
            run.counts["disconnected"] += 1
            return None
        run.counts["lost"] += 1
        run.fail(f"lost {kind} (no answer in {TIMEOUT:.0f}s)", json.dumps(body)[:300])
        return None
    except (httpx.HTTPError, ValueError) as exc:
        run.counts["lost"] += 1
        run.fail(f"lost {kind} ({type(exc).__name__}: {exc})", json.dumps(body)[:300])
        return None
    return _count_status(run, kind, body, answer, hostile)


async def _stream(run: Run, path: str, body: dict, timeout: httpx.Timeout, cut: bool) -> Optional[Answer]:
    """A streamed request: its events, or None when closed on purpose after the first chunk."""
    async with run.client.stream("POST", run.url + path, json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            return Answer(resp.status_code, (await resp.aread()).decode(errors="replace"))
        events: list = []
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            if cut:
                return None  # leaving the block closes the connection mid-stream
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
            else:
                events.append(json.loads(data))
        if not done:
            raise httpx.RemoteProtocolError("stream ended without [DONE]")
        return Answer(200, events)


def _count_status(run: Run, kind: str, body: dict, answer: Answer, hostile: bool) -> Optional[Answer]:
    status = answer.status
    if status >= 500:
        run.counts["http_5xx"] += 1
        run.fail(f"{status} on {kind}", f"{answer.body} <- {json.dumps(body)[:300]}")
        return None
    if 400 <= status < 500:
        run.counts["refused_4xx"] += 1
        if hostile:
            run.counts["hostile_4xx"] += 1
        else:
            run.counts["unintended_4xx"] += 1
            run.fail(f"{status} on {kind} (not a hostile input)", f"{answer.body} <- {json.dumps(body)[:300]}")
        return None
    if status != 200:
        run.fail(f"unexpected {status} on {kind}", answer.body)
        return None
    run.counts["answered_2xx"] += 1
    if hostile:
        run.fail(f"hostile {kind} answered 200", json.dumps(body)[:300])
        return None
    if isinstance(answer.body, list) and any("error" in e for e in answer.body):
        run.counts["stream_errors"] += 1
        run.fail(f"error event in the stream of {kind}", [e for e in answer.body if "error" in e][:1])
        return None
    return answer


# ------------------------------------------------------------------------------------------------
# request kinds: each builds its request, sends it, checks its own contract, verifies its fingerprint


def _sampling(run: Run) -> tuple[int, float]:
    return run.rng.randint(8, 24), run.rng.choice([0.0, 0.0, 0.7, 1.0])


def _openai_body(run: Run, chat: bool, stream: bool = False) -> dict:
    max_tokens, temperature = _sampling(run)
    prompt = run.rng.choice(PROMPTS)
    body: dict = {"model": "default", "max_tokens": max_tokens, "temperature": temperature,
                  "return_input_ids": True, "return_output_ids": True, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _generate_body(run: Run) -> dict:
    max_tokens, temperature = _sampling(run)
    return {"text": run.rng.choice(PROMPTS), "return_input_ids": True, "return_output_ids": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature}}


def _rows_fields(run: Run, fmt: str) -> dict:
    scope = run.rng.choice(["all", "response", "last_n"])
    fields = {"return_hidden_states": True, "hidden_states_format": fmt, "hidden_states_scope": scope,
              "return_final_hidden_state": run.rng.random() < 0.5}
    if scope == "last_n":
        fields["hidden_states_last_n"] = run.rng.randint(1, 6)
    return fields


def _final_choice(events: list, chat: bool) -> Optional[dict]:
    for event in events:
        for choice in event.get("choices", []):
            if choice.get("finish_reason") is not None:
                return (choice.get("delta") or {}) if chat else choice
    return None


def _fields_of(kind: str, body: Any) -> Optional[dict]:
    """Where the sglang-rl response fields of an answer are."""
    if kind in ("chat_stream", "completions_stream"):
        return _final_choice(body, kind == "chat_stream")
    if kind.startswith("chat") or kind == "rows_chat":
        return body["choices"][0]["message"]
    if kind.startswith("completions"):
        return body["choices"][0]
    return body["meta_info"]


def _expected_positions(fields: dict, request: dict) -> list[int]:
    prompt, out = len(fields["input_ids"]), len(fields["output_ids"])
    end = prompt + out if request["return_final_hidden_state"] else prompt + out - 1
    scope = request["hidden_states_scope"]
    if scope == "all":
        return list(range(0, end))
    if scope == "response":
        return list(range(prompt, end))
    return list(range(max(end - request["hidden_states_last_n"], 0), end))


def check_rows(fields: dict, request: dict) -> Optional[str]:
    """None if the rows are the ones asked for (positions, shape, finite), else what is wrong."""
    want = _expected_positions(fields, request)
    if request["hidden_states_format"] == "base64":
        rows, positions = decode_rows_numpy(fields["hidden_states_rows"])
        shape = rows.shape
        finite = bool((abs(rows) < 1e6).all())
    else:
        rows, positions = fields["hidden_states_rows"], fields["hidden_states_positions"]
        shape = (len(rows), len(rows[0]) if rows else 0)
        finite = all(abs(x) < 1e6 for row in rows for x in row)
    if positions != want or shape[0] != len(want) or (want and shape[1] == 0) or not finite:
        return f"rows at {positions} shape {tuple(shape)} finite={finite}, expected positions {want}"
    return None


async def verify(run: Run, ids: list, fp: str, origin: str) -> None:
    """Verify a fingerprint against its own tokens (exact-token form); every one must verify."""
    run.counts["fingerprints"] += 1
    answer = await send(run, "verify", "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                                     FP_IN: fp})
    if answer is None:
        run.counts["fingerprints_unverified"] += 1
        return
    report = json.loads(answer.body["meta_info"][RESULT])
    if report.get("verified") is True:
        run.counts["fingerprints_verified"] += 1
        run.material.append({"ids": ids, "fp": fp})
    else:
        run.counts["fingerprints_unverified"] += 1
        run.fail(f"fingerprint of a {origin} answer does not verify against its own tokens",
                 {k: report.get(k) for k in ("verified", "error", "response_tokens", "worst_exp_mismatches")})


async def generation(run: Run, kind: str, path: str, body: dict, check: Optional[Callable] = None, *,
                     give_up_after: Optional[float] = None, cut_after_first: bool = False) -> None:
    """Send a generation; check its fields; verify its fingerprint."""
    answer = await send(run, kind, path, body, stream=bool(body.get("stream")), cut_after_first=cut_after_first,
                        give_up_after=give_up_after)
    if answer is None:
        return
    fields = _fields_of(kind, answer.body)
    if not fields or not fields.get("output_ids") or not fields.get("input_ids"):
        run.counts["bad_answers"] += 1
        run.fail(f"{kind} answer without ids", str(answer.body)[:500])
        return
    problem = check(fields) if check else None
    if problem:
        run.counts["bad_answers"] += 1
        run.fail(f"{kind}: {problem}", json.dumps(body)[:300])
    fps = fields.get(FP_OUT)
    if body.get("kcbs_enabled"):
        return  # a k-CBS answer carries no fingerprint (its candidates come from beam requests)
    if not (isinstance(fps, list) and fps and isinstance(fps[-1], str)):
        run.counts["bad_answers"] += 1
        run.fail(f"{kind} answer without a fingerprint", str(fields)[:300])
        return
    await verify(run, fields["input_ids"] + fields["output_ids"], fps[-1], kind)


def _kcbs_check(fields: dict) -> Optional[str]:
    candidates = fields.get("kcbs_candidates") or []
    scores = [c["logprob"] for c in candidates]
    if not candidates or scores != sorted(scores, reverse=True) or fields["output_ids"] != candidates[0]["token_ids"]:
        return f"k-CBS candidates {str(candidates)[:300]} for output {fields['output_ids']}"
    return None


async def kind_chat(run: Run) -> None:
    await generation(run, "chat", "/v1/chat/completions", _openai_body(run, chat=True))


async def kind_completions(run: Run) -> None:
    await generation(run, "completions", "/v1/completions", _openai_body(run, chat=False))


async def kind_generate(run: Run) -> None:
    await generation(run, "generate", "/generate", _generate_body(run))


async def kind_chat_stream(run: Run) -> None:
    await generation(run, "chat_stream", "/v1/chat/completions", _openai_body(run, chat=True, stream=True))


async def kind_completions_stream(run: Run) -> None:
    await generation(run, "completions_stream", "/v1/completions", _openai_body(run, chat=False, stream=True))


async def kind_rows_generate(run: Run) -> None:
    rows = _rows_fields(run, "base64")
    await generation(run, "rows_generate", "/generate", {**_generate_body(run), **rows},
                     lambda fields: check_rows(fields, rows))


async def kind_rows_chat(run: Run) -> None:
    rows = _rows_fields(run, run.rng.choice(["list", "base64"]))
    await generation(run, "rows_chat", "/v1/chat/completions", {**_openai_body(run, chat=True), **rows},
                     lambda fields: check_rows(fields, rows))


async def kind_kcbs(run: Run) -> None:
    body = _generate_body(run)
    steps = run.rng.randint(2, 6)
    body["sampling_params"]["max_new_tokens"] = steps
    body.update({"kcbs_enabled": True, "kcbs_beam_width": run.rng.choice([2, 3]), "kcbs_steps": steps})
    await generation(run, "kcbs", "/generate", body, _kcbs_check)


async def kind_verify_earlier(run: Run) -> None:
    """Verify an earlier answer again (a verifier working through a rollout batch)."""
    sample = run.rng.choice(list(run.material))
    await verify(run, sample["ids"], sample["fp"], "earlier")


async def kind_hostile(run: Run) -> None:
    sample = run.rng.choice(list(run.material))
    name, fp = run.rng.choice(sorted(hostile_fingerprints(sample["fp"], run.rng).items()))
    run.counts[f"hostile:{name}"] += 1
    if run.rng.random() < 0.5:
        path, body = "/generate", {"input_ids": sample["ids"], "sampling_params": {"max_new_tokens": 0}, FP_IN: fp}
    else:
        path, body = "/v1/completions", {"model": "default", "prompt": sample["ids"], "max_tokens": 0, FP_IN: fp}
    await send(run, "hostile", path, body, hostile=True)


async def kind_disconnect_stream(run: Run) -> None:
    """A stream closed after its first chunk (sometimes with rows, which must then be dropped)."""
    chat = run.rng.random() < 0.5
    body = _openai_body(run, chat=chat, stream=True)
    if chat and run.rng.random() < 0.5:
        body.update(_rows_fields(run, "base64"))
    await generation(run, "disconnect_stream", "/v1/chat/completions" if chat else "/v1/completions", body,
                     cut_after_first=True)


async def kind_disconnect_timeout(run: Run) -> None:
    """A request whose client gives up after 0.05-1.5 s; an answer that comes sooner is checked."""
    body = _generate_body(run)
    rows = _rows_fields(run, "base64") if run.rng.random() < 0.5 else None
    body.update(rows or {})
    body["sampling_params"]["max_new_tokens"] = 24
    await generation(run, "disconnect_timeout", "/generate", body,
                     (lambda fields: check_rows(fields, rows)) if rows else None,
                     give_up_after=run.rng.uniform(0.05, 1.5))


KINDS: dict[str, tuple[Callable, int]] = {  # kind -> (coroutine, weight in the mix)
    "chat": (kind_chat, 3), "completions": (kind_completions, 2), "generate": (kind_generate, 3),
    "chat_stream": (kind_chat_stream, 2), "completions_stream": (kind_completions_stream, 2),
    "rows_generate": (kind_rows_generate, 2), "rows_chat": (kind_rows_chat, 1), "kcbs": (kind_kcbs, 1),
    "verify_earlier": (kind_verify_earlier, 2), "hostile": (kind_hostile, 2),
    "disconnect_stream": (kind_disconnect_stream, 1), "disconnect_timeout": (kind_disconnect_timeout, 1),
}


def pick(rng: random.Random) -> Callable:
    names = list(KINDS)
    return KINDS[rng.choices(names, weights=[KINDS[n][1] for n in names])[0]][0]


# ------------------------------------------------------------------------------------------------
# phases


def _client(connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=TIMEOUT)


async def _guarded(run: Run, coro) -> None:
    try:
        await coro
    except Exception as exc:  # noqa: BLE001 - a malformed answer is a finding, not a crash of the soak
        run.counts["bad_answers"] += 1
        run.fail(f"unreadable answer ({type(exc).__name__})", exc)


async def warm_up(run: Run) -> None:
    """Every kind a few times, a handful at once: the lazily created threads, buffers and files
    exist before the baseline is taken."""
    for _ in range(3):
        await asyncio.gather(*(_guarded(run, fn(run)) for fn, _ in KINDS.values()))


async def burst(run: Run, n: int) -> None:
    """n requests of the mix at once (their follow-up verifications follow as they finish)."""
    await asyncio.gather(*(_guarded(run, pick(run.rng)(run)) for _ in range(n)))


async def soak(run: Run, seconds: float, concurrency: int) -> None:
    """`concurrency` clients, each sending the next request of the mix as soon as one is done."""
    deadline = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < deadline:
            await _guarded(run, pick(run.rng)(run))

    await asyncio.gather(*(client() for _ in range(concurrency)))


async def run_phase(url: str, rng: random.Random, material: deque, connections: int, phase: Callable) -> Run:
    async with _client(connections) as client:
        run = Run(url, client, rng, material)
        await phase(run)
        return run


# ------------------------------------------------------------------------------------------------
# the server once idle


def server_processes(server: Server) -> list[psutil.Process]:
    root = psutil.Process(server.proc.pid)
    return [root, *root.children(recursive=True)]


def python_thread_names(pid: int) -> Optional[Counter]:
    """Python's names of a process's threads, read with py-spy (an sglang dependency): CPython
    3.11 does not pass them to the OS, so /proc/<pid>/task/*/comm shows only the process name.
    None if py-spy is missing or may not attach."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = Counter(re.findall(r'^Thread \S+ \([^)]*\): "([^"]*)"', out.stdout, flags=re.M))
    return names if out.returncode == 0 and names else None


def idle_state(server: Server, settle: float) -> dict:
    """Wait until nothing runs or waits, let deliveries finish, then read the server's state."""
    deadline = time.monotonic() + 300
    while True:
        load = requests.get(server.url + "/v1/loads", params={"include": "core,memory"}, timeout=60).json()["loads"][0]
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    time.sleep(settle)
    load = requests.get(server.url + "/v1/loads", params={"include": "core,memory"}, timeout=60).json()["loads"][0]
    procs = server_processes(server)
    pids = {p.pid for p in procs}
    prefixes = tuple(f"sglang-rl-rows-{pid}-" for pid in pids)
    threads, python_threads = {}, {}
    for proc in procs:
        key = f"{' '.join(proc.cmdline()[:1]) or proc.name()}[{proc.pid}]"
        threads[key] = proc.num_threads()
        python_threads[key] = dict(python_thread_names(proc.pid) or {})
    scheduler = next((names for key, names in python_threads.items() if "scheduler" in key), {})
    return {
        "rss_mb": round(sum(p.memory_info().rss for p in procs) / 2**20),
        "rss_mb_by_process": {f"{p.name()}[{p.pid}]": round(p.memory_info().rss / 2**20) for p in procs},
        "threads": threads,
        "python_threads": python_threads,
        "toploc_threads": sum(n for name, n in scheduler.items() if name.startswith(TOPLOC_THREADS)),
        "shm_row_files": sorted(f for f in os.listdir(shm_dir()) if f.startswith(prefixes)),
        "kv_used_tokens": load["num_used_tokens"],
        "kv_capacity": load["max_total_num_tokens"],
        "running": load["num_running_reqs"],
        "waiting": load["num_waiting_reqs"],
    }


def rss_limit(baseline_mb: int, tolerance: float, floor_mb: int) -> int:
    """The most RSS an idle server may have: the warm-up baseline plus `tolerance` of it or
    `floor_mb`, whichever is larger. The warm-up runs a handful of requests at once, the burst
    hundreds: the larger batches grow the allocator's cached arenas and sglang's per-batch buffers
    once, which glibc and torch keep. A leak grows with the number of requests instead, so the
    soak's many thousands of requests would carry it past the bound."""
    return baseline_mb + max(int(baseline_mb * tolerance), floor_mb)


def _families(names: dict) -> Counter:
    """Thread counts by name without the pool index ("uvloop_3" -> "uvloop")."""
    families: Counter = Counter()
    for name, n in names.items():
        families[re.sub(r"_\d+$", "", name)] += n
    return families


def thread_problems(state: dict, baseline: dict) -> list[str]:
    """Threads above the warm-up level, per process and Python thread name. Only the event
    loop's default executor (`asyncio.to_thread`, which delivers encoded rows) may have grown: it
    starts a thread when none is idle, up to its bound, so a burst grows it once. Threads without
    a Python name (torch, OpenMP) are compared by count."""
    problems = []
    for proc, count in state["threads"].items():
        names, base = state["python_threads"].get(proc, {}), baseline["python_threads"].get(proc, {})
        base_count = baseline["threads"].get(proc, 0)
        if not names or not base:
            if count > base_count:
                problems.append(f"{proc} has {count} threads, {base_count} at warm-up")
            continue
        now, then = _families(names), _families(base)
        for family, n in now.items():
            limit = LOOP_POOL_BOUND if family in LOOP_POOLS else then.get(family, 0)
            if n > limit:
                problems.append(f"{proc} has {n} threads named {family}*, {then.get(family, 0)} at warm-up")
        if count - sum(names.values()) > base_count - sum(base.values()):
            problems.append(f"{proc} has {count - sum(names.values())} threads without a Python name, "
                            f"{base_count - sum(base.values())} at warm-up")
    return problems


def idle_problems(name: str, state: dict, baseline: dict, limit_mb: int) -> list[str]:
    problems = []
    if state["running"] or state["waiting"] or state["kv_used_tokens"]:
        problems.append(f"{name}: {state['running']} running, {state['waiting']} waiting, "
                        f"{state['kv_used_tokens']} KV tokens in use once idle")
    if len(state["shm_row_files"]) > len(baseline["shm_row_files"]):
        problems.append(f"{name}: row files left in {shm_dir()}: {state['shm_row_files'][:5]}")
    problems += [f"{name}: {p}" for p in thread_problems(state, baseline)]
    if state["toploc_threads"] > baseline["toploc_threads"]:
        problems.append(f"{name}: {state['toploc_threads']} {TOPLOC_THREADS} threads, "
                        f"{baseline['toploc_threads']} at warm-up")
    if state["rss_mb"] > limit_mb:
        problems.append(f"{name}: RSS {state['rss_mb']} MB > {limit_mb} MB")
    return problems


# ------------------------------------------------------------------------------------------------


def summary_line(counts: Counter, states: dict, seconds: dict, ok: bool, alive: bool) -> str:
    c = counts
    return (f"soak: {'PASS' if ok else 'FAIL'} | burst {c['burst_sent']} sent in {seconds['burst']:.0f}s, "
            f"soak {c['soak_sent']} sent in {seconds['soak']:.0f}s | {c['sent']} requests, "
            f"{c['answered_2xx']} 2xx, {c['refused_4xx']} 4xx ({c['unintended_4xx']} unintended), "
            f"{c['http_5xx']} 5xx, {c['lost']} lost, {c['disconnected']} disconnected on purpose | "
            f"fingerprints {c['fingerprints_verified']}/{c['fingerprints']} verified | "
            f"hostile {c['hostile_4xx']}/{c['hostile_sent']} got 4xx | bad answers {c['bad_answers']} | "
            f"idle RSS MB warm-up/burst/soak {states['warm-up']['rss_mb']}/{states['burst']['rss_mb']}/"
            f"{states['soak']['rss_mb']} | KV tokens in use {states['soak']['kv_used_tokens']} | "
            f"/dev/shm row files {len(states['soak']['shm_row_files'])} | threads warm-up->soak: "
            f"{_threads(states['warm-up'], states['soak'])} | server alive {alive}")


def _thread_counts(state: dict, process: str, prefixes: tuple) -> tuple[int, int]:
    """(all threads, threads whose Python name starts with a prefix) of the first process whose
    name contains `process` ("" for the launcher: HTTP server and tokenizer manager)."""
    proc = next((p for p in state["threads"] if process in p), None)
    if proc is None:
        return 0, 0
    named = state["python_threads"].get(proc, {})
    return state["threads"][proc], sum(n for name, n in named.items() if name.startswith(prefixes))


def _threads(before: dict, after: dict) -> str:
    (s0, w0), (s1, w1) = (_thread_counts(x, "scheduler", (TOPLOC_THREADS,)) for x in (before, after))
    (h0, p0), (h1, p1) = (_thread_counts(x, "", LOOP_POOLS) for x in (before, after))
    return (f"scheduler {s0}->{s1} (proof workers {w0}->{w1}), HTTP process {h0}->{h1} "
            f"(loop pool {p0}->{p1}, bound {LOOP_POOL_BOUND})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, default=256, help="requests sent at once (default 256)")
    parser.add_argument("--soak-seconds", type=float, default=600.0, help="length of the soak (default 600)")
    parser.add_argument("--concurrency", type=int, default=32, help="clients during the soak (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle", type=float, default=15.0, help="seconds idle before reading the state")
    parser.add_argument("--rss-tolerance", type=float, default=0.15, help="fraction of the baseline RSS")
    parser.add_argument("--rss-floor-mb", type=int, default=300, help="RSS slack at least this many MB")
    parser.add_argument("--json", help="also write the counts and idle states to this file")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    t_start = time.time()
    server = start_feature_server("soak", *SERVER_ARGS)
    print(f"soak: server on {server.url}, log {server.log_path}", flush=True)
    try:
        material: deque = deque([honest_sample(server.url)], maxlen=64)
        warm = asyncio.run(run_phase(server.url, rng, material, 64, warm_up))
        states = {"warm-up": idle_state(server, args.settle)}
        print(f"soak: warm-up {warm.counts['sent']} requests; idle: {json.dumps(states['warm-up'])}", flush=True)
        seconds = {}
        t0 = time.time()
        burst_run = asyncio.run(run_phase(server.url, rng, material, args.burst + 64,
                                          lambda run: burst(run, args.burst)))
        seconds["burst"] = time.time() - t0
        states["burst"] = idle_state(server, args.settle)
        print(f"soak: burst {burst_run.counts['sent']} requests in {seconds['burst']:.0f}s; "
              f"idle: {json.dumps(states['burst'])}", flush=True)
        t0 = time.time()
        soak_run = asyncio.run(run_phase(server.url, rng, material, args.concurrency + 16,
                                         lambda run: soak(run, args.soak_seconds, args.concurrency)))
        seconds["soak"] = time.time() - t0
        states["soak"] = idle_state(server, args.settle)
        print(f"soak: soak {soak_run.counts['sent']} requests in {seconds['soak']:.0f}s; "
              f"idle: {json.dumps(states['soak'])}", flush=True)

        counts = warm.counts + burst_run.counts + soak_run.counts
        counts["burst_sent"], counts["soak_sent"] = burst_run.counts["sent"], soak_run.counts["sent"]
        failures = warm.failures + burst_run.failures + soak_run.failures
        limit = rss_limit(states["warm-up"]["rss_mb"], args.rss_tolerance, args.rss_floor_mb)
        problems = idle_problems("after the burst", states["burst"], states["warm-up"], limit)
        problems += idle_problems("after the soak", states["soak"], states["warm-up"], limit)
        alive = server.alive()
        log = server.log_path.read_text(errors="replace")
        log_counts = {pattern: log.count(pattern) for pattern in LOG_PATTERNS}
        checks = {
            "no 5xx": counts["http_5xx"] == 0,
            "none lost": counts["lost"] == 0,
            "every 4xx intended": counts["unintended_4xx"] == 0,
            "every hostile input got a 4xx": counts["hostile_4xx"] == counts["hostile_sent"],
            "every fingerprint verified": counts["fingerprints_verified"] == counts["fingerprints"],
            "every answer well-formed": counts["bad_answers"] == 0 and counts["stream_errors"] == 0,
            "no traceback or leak report in the server log": not (log_counts["Traceback"] + log_counts["leak"]),
            "idle state back to warm-up level": not problems,
            "server alive": alive,
        }
        ok = all(checks.values())
        for failure in failures:
            print(f"FAILURE {failure}")
        for problem in problems:
            print(f"IDLE {problem}")
        for name, passed in checks.items():
            print(f"check {'ok  ' if passed else 'FAIL'} {name}")
        print("per kind: " + ", ".join(f"{k[5:]} {v}" for k, v in sorted(counts.items()) if k.startswith("sent:")))
        print("hostile: " + ", ".join(f"{k[8:]} {v}" for k, v in sorted(counts.items()) if k.startswith("hostile:")))
        print(f"server log {server.log_path}: " + ", ".join(f"{n} x {k!r}" for k, n in log_counts.items()))
        print(f"RSS limit {limit} MB (warm-up {states['warm-up']['rss_mb']} MB + max({args.rss_tolerance:.0%}, "
              f"{args.rss_floor_mb} MB)); total {time.time() - t_start:.0f}s")
        print(summary_line(counts, states, seconds, ok, alive), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "counts": counts, "states": states, "seconds": seconds,
                           "checks": checks, "failures": failures, "idle_problems": problems,
                           "rss_limit_mb": limit, "server_log": log_counts}, f, indent=1)
        sys.exit(0 if ok else 1)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
