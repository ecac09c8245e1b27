"""Differential checking against sglang itself: the same request to a server with the plugin
disabled (the oracle) and to one with it loaded, and the two answers compared after removing what
differs by nature (ids, timestamps, latencies) and the fields the plugin was asked for.

A case is `Case(name, path, body, plugin_fields, replaced)`: `body` goes to the plugin server as
it is and to the oracle without `plugin_fields` (its top level and its `sampling_params`), and
`replaced` names the oracle's fields that those plugin fields replace. Streams are
compared as what a client assembles from them: the text of each choice, its log-probs, and every
chunk that carries anything else (finish reason, hidden states, usage), in order; where sglang
splits the text into chunks depends on timing, what the client assembles does not.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import requests

from e2e_servers import Spec
from hidden_states_fixtures import HS_NORADIX
from toploc_helpers import sse_events

CALIBRATION = Path(__file__).resolve().parents[2] / "docs" / "results" / "cpu_smollm2_calibration.json"

# The TOPLOC server of test_upstream_differential (which compares its answers with sglang's) and
# of test_toploc_calibration (which verifies on it with the calibration file's bounds).
DIFFERENTIAL_TOPLOC = Spec("differential-toploc", (*HS_NORADIX.args, "--toploc-verification",
                                                   "--toploc-verification-calibration", str(CALIBRATION)),
                           random_weights=True)

TIMEOUT = 300

# Keys whose values differ between two runs of the same server by nature.
VOLATILE_KEYS = frozenset({
    "id", "created", "e2e_latency", "response_sent_to_client_ts",
    # /get_server_info: this process's ports (the test harness gives each server its own HTTP and
    # rendezvous port), seed and start-up measurements
    "port", "nccl_port", "random_seed", "mem_fraction_static", "memory_usage", "startup_time",
    "last_gen_throughput",
})
# Stream chunk keys that carry text (assembled per choice, not compared chunk by chunk).
_TEXT_KEYS = ("text", "content", "reasoning_content")


@dataclass
class Case:
    """One request of the differential suite."""

    name: str
    path: str
    body: Optional[dict] = None  # None: GET
    plugin_fields: tuple[str, ...] = ()
    # response keys the plugin's fields replace in the oracle's answer (upstream's hidden states
    # when the plugin's rows were asked for instead)
    replaced: tuple[str, ...] = ()
    stream: bool = field(init=False)

    def __post_init__(self) -> None:
        self.stream = bool((self.body or {}).get("stream"))

    def oracle_body(self) -> Optional[dict]:
        if self.body is None:
            return None
        body = copy.deepcopy(self.body)
        for name in self.plugin_fields:
            body.pop(name, None)
            params = body.get("sampling_params")
            for p in params if isinstance(params, list) else [params]:
                if isinstance(p, dict):
                    p.pop(name, None)
        return body


def call(url: str, case: Case, body: Optional[dict]) -> Any:
    """The answer of one server: JSON, or for a stream the list of its events."""
    if body is None:
        resp = requests.get(url + case.path, timeout=TIMEOUT)
    else:
        resp = requests.post(url + case.path, json=body, timeout=TIMEOUT, stream=case.stream)
    if resp.status_code != 200:
        return {"status": resp.status_code, "body": resp.text[:500]}
    return sse_events(resp) if case.stream else resp.json()


def strip(value: Any, drop: frozenset) -> Any:
    """`value` without the keys in `drop`, at any depth, except the top-level keys of a
    /generate output (its own `output_ids` is upstream's, the plugin's is in `meta_info`)."""
    if isinstance(value, dict):
        generate_output = "meta_info" in value and "text" in value
        return {k: strip(v, drop) for k, v in value.items() if generate_output or k not in drop}
    if isinstance(value, list):
        return [strip(v, drop) for v in value]
    return value


def assemble_openai_stream(events: list[dict]) -> dict:
    """What a client assembles from an OpenAI stream: per choice its text and log-probs, and the
    chunks that carry anything besides text, in order; plus the chunks without choices (usage)."""
    choices: dict[int, dict] = {}
    others = []
    for event in events:
        if not event.get("choices"):
            others.append(event)
            continue
        for choice in event["choices"]:
            slot = choices.setdefault(choice.get("index", 0), {"text": {}, "logprobs": [], "chunks": []})
            rest = dict(choice)
            for holder in (rest, dict(rest.get("delta") or {})):
                for key in _TEXT_KEYS:
                    if holder.get(key):
                        slot["text"][key] = slot["text"].get(key, "") + holder[key]
            logprobs = rest.pop("logprobs", None)
            if logprobs:
                slot["logprobs"].append(logprobs)
            delta = {k: v for k, v in (rest.pop("delta", None) or {}).items() if k not in _TEXT_KEYS}
            rest = {k: v for k, v in rest.items() if k not in _TEXT_KEYS and k != "index"}
            meaningful = {k: v for k, v in {**rest, **delta}.items() if v not in (None, [], {}, "")}
            if meaningful:
                slot["chunks"].append({**rest, "delta": delta} if "delta" in choice else rest)
    for slot in choices.values():
        slot["logprobs"] = _merge_logprobs(slot["logprobs"])
    return {"choices": choices, "others": others}


def _merge_logprobs(parts: list) -> Any:
    """One log-probs record from a stream's per-chunk records (lists concatenated key by key)."""
    if not parts:
        return None
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, list):
                merged.setdefault(key, []).extend(value)
            else:
                merged[key] = value
    return merged


def assemble_generate_stream(events: list[dict]) -> dict:
    """/generate streams cumulative outputs: the last event, and which keys each event carried."""
    return {"last": events[-1] if events else None,
            "keys": sorted({k for e in events for k in (e.get("meta_info") or {})})}


def comparable(case: Case, answer: Any, drop: frozenset) -> Any:
    """An answer reduced to what must be equal between the plugin and the oracle: the keys in
    `drop` removed first, then a stream assembled as a client would."""
    answer = strip(answer, drop)
    if case.stream and isinstance(answer, list):
        return assemble_generate_stream(answer) if case.path == "/generate" else assemble_openai_stream(answer)
    return answer


def first_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    """Where two JSON values first differ, as a path and the two values (None when equal)."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} {str(a)[:200]} != {type(b).__name__} {str(b)[:200]}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                side = "plugin only" if key in a else "oracle only"
                return f"{path}.{key}: {side} ({str(a.get(key, b.get(key)))[:200]})"
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {str(a)[:200]} != {str(b)[:200]}"


def compare(case: Case, oracle_url: str, servers: dict[str, tuple[str, tuple[str, ...]]]) -> list[str]:
    """The first difference between each plugin server's answer to `case` and the oracle's.
    `servers`: name -> (url, response fields a flag of that server asked for). The servers are
    asked at the same time, each one request at a time, so each batches as it would alone."""
    with ThreadPoolExecutor(len(servers) + 1) as pool:
        theirs = pool.submit(call, oracle_url, case, case.oracle_body())
        mine = {name: pool.submit(call, url, case, case.body) for name, (url, _) in servers.items()}
    expected = comparable(case, theirs.result(), VOLATILE_KEYS | set(case.replaced))
    found = []
    for name, (_, server_fields) in servers.items():
        got = comparable(case, mine[name].result(),
                         VOLATILE_KEYS | set(server_fields) | set(plugin_response_fields(case)))
        difference = first_difference(got, expected)
        if difference:
            found.append(f"{case.name} ({name}): {difference}")
    return found


def plugin_response_fields(case: Case) -> tuple[str, ...]:
    """The response fields that the plugin fields of a case ask for."""
    out: list[str] = []
    fields = set(case.plugin_fields)
    if fields & {"return_input_ids"}:
        out.append("input_ids")
    if fields & {"return_output_ids"}:
        out.append("output_ids")
    if fields & {"hidden_states_format", "hidden_states_scope", "hidden_states_last_n",
                 "return_final_hidden_state"}:
        out += ["hidden_states_rows", "hidden_states_positions"]
    return tuple(out)
