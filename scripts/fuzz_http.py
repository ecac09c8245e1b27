"""HTTP fuzzing of every sglang-rl request field and of the fingerprint container: `make fuzz`.

Starts one CPU server with TOPLOC and hidden states on, records honest material (a generation with
its ids and fingerprint, and a canary request's greedy output), then sends N seeded random cases
to /generate, /v1/completions and /v1/chat/completions (batches included), several at a time.
Each field gets values from a pool of valid ones, wrong types, out-of-range numbers, odd strings
and nested lists; fingerprints are valid ones, mutated ones (bit flips, truncation, spliced
headers, random bytes) and other requests' ones. A quarter of the cases also carry sglang's own
grammar constraints (regex, json_schema, ebnf; response_format json_schema/json_object on the
OpenAI endpoints), valid and malformed (those get sglang's own 400). Every answer must be a 400
with a reason or a well-formed 200; never a 5xx, a hang or a dead server. Every 250 cases the
canary must still get its original greedy output (no request affects another). Prints a one-line
summary and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import requests

from load_common import honest_sample, start_feature_server  # the server and material `make soak` uses too

from sglang_rl.request_options import ALL_FIELDS

FP = "toploc_verification_fingerprint_to_validate"
ODD = [None, True, False, 0, 1, -1, 2, 7, 2**31, -(2**63), 1e300, float("nan"), 0.5, "", "x", "true",
       "last", "all", "response", "last_n", "base64", "list", "tensor", "\u0000\ud7ff", "A" * 5000, [], [1],
       [True, False], {}, {"a": 1}, [[1, 2], [3]], [None]]
VALID = {
    "return_input_ids": [True, False], "return_output_ids": [True, False],
    "toploc_verification_expect_greedy": [True, False],
    "toploc_verification_expect_sampled": [True, False],
    "hidden_states_format": ["list", "base64"], "hidden_states_scope": ["all", "response", "last_n"],
    "hidden_states_last_n": [1, 3, 8], "return_final_hidden_state": [True, False],
    "kcbs_enabled": [True, False], "kcbs_beam_width": [1, 2, 3], "kcbs_steps": [1, 2],
    "kcbs_final_prune": [True, False], "drafter_cotrain": [False],
}

# sglang's own grammar fields, valid and malformed; a list or dict as a grammar and a NUL in one
# kill sglang's scheduler, so sglang-rl refuses them (request_options.validate_grammar). Left
# out: a truthy non-dict response_format, which sglang's chat request validator answers with a
# 500 (sglang's own answer, not a lost server).
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = [SCHEMA, {"type": "object"}, {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
           {"enum": ["a", "b"]}, {}, {"type": "nonsense"}, {"type": 5}, {"$ref": "#/nope"},
           {"type": "string", "pattern": "(["}, {"type": "integer", "minimum": 5, "maximum": 1}]
GRAMMARS = {
    "regex": [r"(yes|no),[0-9]{3}", r"[a-z]{1,6}", r"\d+", r"(a|b)*c", r"(yes|no), [0-9]{3}", "A" * 300,
              "", "(unclosed[", "*", "a{3,1}", "\\", "(?<=x)y", "[z-a]", 5, True, None,
              ["yes", "no"], {"a": 1}, "\x00a", "a\x00"],
    "json_schema": [json.dumps(s) for s in SCHEMAS] + ["{not json", "", "null", "[]", 7, SCHEMA,
                                                       json.dumps({"type": "string", "pattern": "\x00a"})],
    "ebnf": ['root ::= "yes" | "no"', "root ::= [0-9]+", "", "root ::= (", 'x ::= "a"', "root ::= undefined"],
    "response_format": [{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}, {"type": "bogus"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": "zz"}}, None, {},
                        *({"type": "json_schema", "json_schema": {"name": "x", "schema": s}} for s in SCHEMAS)],
}


def grammar_fields(rng: random.Random, openai: bool) -> dict:
    """One grammar constraint, now and then two (which sglang must refuse)."""
    kinds = [k for k in GRAMMARS if openai or k != "response_format"]
    return {k: rng.choice(GRAMMARS[k]) for k in rng.sample(kinds, 1 if rng.random() < 0.9 else 2)}


def mutate_fingerprint(rng: random.Random, fp: str) -> str:
    raw = bytearray(base64.b64decode(fp))
    kind = rng.randrange(6)
    if kind == 0 and raw:
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        raw = raw[: rng.randrange(len(raw) + 1)]
    elif kind == 2:
        raw = raw[:12] + bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    elif kind == 3 and len(raw) > 12:
        raw[rng.randrange(12)] = rng.randrange(256)
    elif kind == 4:
        return fp[: rng.randrange(len(fp))] + rng.choice(["!", "=", "==", "\n", "é"])
    else:
        raw += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
    return base64.b64encode(bytes(raw)).decode()


def field_value(rng: random.Random, name: str, material: dict):
    roll = rng.random()
    if name == FP:
        if roll < 0.3:
            return material["fp"]
        if roll < 0.8:
            return mutate_fingerprint(rng, material["fp"])
        return rng.choice(ODD)
    if roll < 0.6 and name in VALID:
        return rng.choice(VALID[name])
    return rng.choice(ODD)


def make_case(rng: random.Random, material: dict) -> tuple[str, dict]:
    fields = {n: field_value(rng, n, material) for n in rng.sample(ALL_FIELDS, rng.randrange(1, 5))}
    if rng.random() < 0.3:
        fields["return_hidden_states"] = rng.choice([True, "last", False, 3, "x"])
    verify = FP in fields
    max_tokens = 0 if verify and rng.random() < 0.8 else rng.choice([0, 1, 2, 4, -1])
    endpoint = rng.choice(["generate", "generate", "completions", "chat", "generate-batch"])
    grammar = grammar_fields(rng, endpoint in ("completions", "chat")) if rng.random() < 0.25 else {}
    if grammar and not verify and rng.random() < 0.5:
        max_tokens = 16  # long enough for the grammar's mask to steer several steps
    ids = material["ids"]
    if endpoint == "generate":
        prompt = {"input_ids": ids} if verify else {"text": rng.choice(["Hi", "Count: 1, 2,", ""])}
        return "/generate", {**prompt, "sampling_params": {"max_new_tokens": max_tokens, **grammar,
                                                           "temperature": rng.choice([0, 1.0])}, **fields}
    if endpoint == "generate-batch":
        n = rng.randrange(1, 4)
        per_item = {k: [v] * rng.choice([n, n, n + 1]) for k, v in fields.items() if rng.random() < 0.5}
        # only sglang-rl fields go inside sampling_params (sglang itself answers an unknown sampling
        # parameter such as return_hidden_states there with a 500: not ours to fuzz)
        params = [{"max_new_tokens": max_tokens, **{k: v for k, v in fields.items() if k not in per_item
                                                     and k in ALL_FIELDS and rng.random() < 0.5},
                   **(grammar if rng.random() < 0.5 else {})}
                  for _ in range(n)]
        per_item.update({k: v for k, v in fields.items() if k not in ALL_FIELDS})
        return "/generate", {"input_ids": [ids] * n, "sampling_params": params, **per_item}
    if endpoint == "completions":
        return "/v1/completions", {"model": "default", "prompt": ids if verify else "Hello",
                                   "max_tokens": max_tokens, "stream": rng.random() < 0.2, **grammar, **fields}
    return "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": max_tokens, "stream": rng.random() < 0.2, **grammar, **fields}


def judge(resp: requests.Response) -> str:
    """'ok', 'refused', or a violation description."""
    if resp.status_code >= 500:
        return f"{resp.status_code}: {resp.text[:300]}"
    if resp.status_code in (400, 422):
        return "refused" if len(resp.text) > 10 else f"{resp.status_code} without a reason"
    if resp.status_code != 200:
        return f"unexpected {resp.status_code}: {resp.text[:300]}"
    text = resp.text
    if text.startswith("data:"):
        return "ok" if "[DONE]" in text or '"error"' in text else "stream without [DONE]"
    try:
        json.loads(text)
    except ValueError:
        return "200 with a body that is not JSON"
    return "ok"


def send(url: str, path: str, body: dict) -> str:
    try:
        return judge(requests.post(url + path, data=json.dumps(body, allow_nan=True),
                                   headers={"Content-Type": "application/json"}, timeout=300))
    except requests.RequestException as exc:
        return f"transport error: {exc}"


def canary(url: str) -> list[int]:
    resp = requests.post(url + "/generate", json={"text": "The capital of France is", "return_output_ids": True,
                                                 "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
                         timeout=300)
    resp.raise_for_status()
    return resp.json()["meta_info"]["output_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    server = start_feature_server("fuzz")
    try:
        url = server.url
        material = honest_sample(url)
        reference = canary(url)
        rng = random.Random(args.seed)
        counts: Counter = Counter()
        violations: list[tuple[str, dict, str]] = []
        t0 = time.time()
        with ThreadPoolExecutor(args.concurrency) as pool:
            for start in range(0, args.cases, 250):
                cases = [make_case(rng, material) for _ in range(min(250, args.cases - start))]
                for (path, body), verdict in zip(cases, pool.map(lambda c: send(url, *c), cases)):
                    counts[verdict if verdict in ("ok", "refused") else "violation"] += 1
                    if verdict not in ("ok", "refused"):
                        violations.append((path, body, verdict))
                if not server.alive():
                    violations.append(("server", {}, "the server died"))
                    break
                if canary(url) != reference:
                    violations.append(("canary", {}, "the canary's greedy output changed"))
        for path, body, verdict in violations[:10]:
            print(f"VIOLATION {path}: {verdict}\n  {json.dumps(body, allow_nan=True)[:600]}")
        print(f"fuzz: {sum(counts.values())} cases in {time.time() - t0:.0f}s, {counts['ok']} answered, "
              f"{counts['refused']} refused with a reason, {len(violations)} violations, "
              f"server alive: {server.alive()}")
        sys.exit(1 if violations else 0)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
