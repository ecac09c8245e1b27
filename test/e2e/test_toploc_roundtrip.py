"""Honest round trips: every response of the real server verifies on the same server.

36 varied single-choice requests (prompt lengths 1..300 tokens, max_tokens in {1, 5, 33, 70},
EOS and length stops, greedy and sampled, /generate, /v1/completions and /v1/chat/completions,
streaming and not) plus n=2 requests, all sent at once so generations and verifications share
batches. Each response is verified in the exact-token form (via /generate or /v1/completions);
chat responses also in the chat form. Every verification must pass, greedy ones must be
greedy-consistent, and every fingerprint must hold ceil(n/32) proofs.
"""

from __future__ import annotations

import random

import pytest

from toploc_helpers import (
    chunks_for,
    decode,
    gen_chat,
    gen_completions,
    gen_generate,
    pmap,
    record,
    stats,
    verify_sample,
)

MAX_TOKENS = (1, 5, 33, 70)
ENDPOINTS = (
    ("generate", False), ("generate", True),
    ("completions", False), ("completions", True),
    ("chat", False), ("chat", True),
)
PROMPT_LENGTHS = (1, 2, 3, 5, 8, 13, 21, 31, 32, 33, 47, 64, 90, 128, 160, 200, 255, 256, 280, 300)
BASE_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made and who could read them. ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, ",
    "Question: What is the boiling point of water at sea level? Answer: 100 degrees Celsius.\n",
    "Les chats dorment beaucoup pendant la journée, surtout quand il fait chaud. ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat. ",
    "- apples\n- bananas\n- cherries\n- dates\n",
)
SHORT_QUESTIONS = (
    "What is 2+2?", "Say hello.", "Name a primary color.", "What is the capital of Italy?",
    "Translate 'cat' to French.", "Is the sun a star? Answer yes or no.", "Hi", "Give me one word.",
)
LONG_QUESTIONS = (
    "Write a short poem about autumn leaves.", "Explain how a bicycle works.",
    "List five animals that live in the ocean.", "Tell me a story about a robot.",
)


def _token_prompt(tokenizer, length: int, base: str) -> list[int]:
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(base, add_special_tokens=False)
    return ids[:length]


def _chat_messages(tokenizer, i: int, rng: random.Random) -> list[dict]:
    kind = i % 3
    if kind == 0:
        return [{"role": "user", "content": SHORT_QUESTIONS[i % len(SHORT_QUESTIONS)]}]
    if kind == 1:
        return [{"role": "user", "content": LONG_QUESTIONS[i % len(LONG_QUESTIONS)]}]
    # a long context built from repeated text: ~100-270 prompt tokens with the template
    context = BASE_TEXTS[i % len(BASE_TEXTS)] * rng.randint(3, 9)
    context = tokenizer.decode(tokenizer.encode(context, add_special_tokens=False)[:240])
    return [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": context + "\n\nSummarize the text above in one sentence."},
    ]


def build_cases(tokenizer) -> list[dict]:
    rng = random.Random(20261121)
    cases = []
    token_cases = chat_cases = 0  # token cases take the prompt lengths in turn (7 is prime to 20)
    for i in range(36):  # every endpoint x stream x max_tokens pairing at least once
        endpoint, stream = ENDPOINTS[i % 6]
        max_tokens = MAX_TOKENS[(i // 6) % 4]
        temperature = 0.8 if i % 5 == 4 else 0.0
        case = {"id": i, "endpoint": endpoint, "stream": stream, "max_tokens": max_tokens,
                "temperature": temperature, "n": 1}
        if endpoint == "chat":
            case["messages"] = _chat_messages(tokenizer, chat_cases, rng)  # the three kinds in turn
            if chat_cases % 3 == 0:  # short questions: their answers stop by EOS before the limit
                case["max_tokens"] = 70
            chat_cases += 1
        else:
            length = PROMPT_LENGTHS[(token_cases * 7) % len(PROMPT_LENGTHS)]
            token_cases += 1
            case["input_ids"] = _token_prompt(tokenizer, length, BASE_TEXTS[i % len(BASE_TEXTS)])
        cases.append(case)
    # n=2 (sampled) on every endpoint
    cases.append({"id": 36, "endpoint": "chat", "stream": False, "max_tokens": 33, "temperature": 0.8, "n": 2,
                  "messages": [{"role": "user", "content": "Tell me a fun fact about space."}]})
    cases.append({"id": 37, "endpoint": "chat", "stream": True, "max_tokens": 40, "temperature": 0.9, "n": 2,
                  "messages": [{"role": "user", "content": "Describe the sea."}]})
    cases.append({"id": 38, "endpoint": "completions", "stream": True, "max_tokens": 40, "temperature": 0.8,
                  "n": 2, "input_ids": _token_prompt(tokenizer, 20, BASE_TEXTS[5])})
    cases.append({"id": 39, "endpoint": "generate", "stream": False, "max_tokens": 36, "temperature": 0.9,
                  "n": 2, "input_ids": _token_prompt(tokenizer, 150, BASE_TEXTS[0])})
    return cases


def run_case(url: str, case: dict) -> dict:
    """Generate, then verify every choice in every applicable form (same worker thread, so
    verification prefills share batches with other workers' decodes)."""
    kw = dict(max_tokens=case["max_tokens"], temperature=case["temperature"], stream=case["stream"], n=case["n"])
    if case["endpoint"] == "generate":
        samples = gen_generate(url, input_ids=case["input_ids"], **kw)
    elif case["endpoint"] == "completions":
        samples = gen_completions(url, case["input_ids"], **kw)
    else:
        samples = gen_chat(url, case["messages"], **kw)
    greedy = case["temperature"] == 0.0
    results = []
    for k, sample in enumerate(samples):
        forms = [("tokens", "generate" if (case["id"] + k) % 2 == 0 else "completions")]
        if case["endpoint"] == "chat":
            forms.append(("chat", None))
        for form, via in forms:
            report = verify_sample(url, sample, form, via=via or "generate", expect_greedy=greedy or None)
            results.append({"case": case["id"], "choice": k, "form": form, "via": via, "sample": sample,
                            "report": report, "greedy": greedy})
    return {"case": case, "samples": samples, "results": results}


@pytest.fixture(scope="module")
def roundtrips(toploc_server, tokenizer) -> list[dict]:
    cases = build_cases(tokenizer)
    return pmap(lambda c: run_case(toploc_server.url, c), cases, workers=len(cases))


def _results(roundtrips, form=None) -> list[dict]:
    return [r for rt in roundtrips for r in rt["results"] if form is None or r["form"] == form]


def _failure(r: dict) -> dict:
    return {"case": r["case"], "choice": r["choice"], "form": r["form"], "endpoint": r["sample"]["endpoint"],
            "stream": r["sample"]["stream"], "text": r["sample"]["text"][:60], **stats(r["report"])}


def test_pass_rate_is_recorded(roundtrips) -> None:
    """Print the measured pass rate of all honest verifications (asserted per form below)."""
    results = _results(roundtrips)
    by_form: dict[str, list[int]] = {}
    for r in results:
        key = f"{r['form']}-form:{r['sample']['endpoint']}:{'stream' if r['sample']['stream'] else 'plain'}"
        by_form.setdefault(key, [0, 0])
        by_form[key][0] += r["report"].get("verified") is True
        by_form[key][1] += 1
    passed = sum(r["report"].get("verified") is True for r in results)
    record("roundtrip_pass_rate", passed=passed, total=len(results), rate=round(passed / len(results), 4),
           requests=len(roundtrips), samples=sum(len(rt["samples"]) for rt in roundtrips),
           by_form={k: f"{a}/{b}" for k, (a, b) in sorted(by_form.items())},
           failures=[_failure(r) for r in results if r["report"].get("verified") is not True][:10])
    assert len(roundtrips) >= 40 and len(results) >= 60


def test_exact_token_form_round_trips_verify(roundtrips) -> None:
    results = _results(roundtrips, "tokens")
    failures = [_failure(r) for r in results if r["report"].get("verified") is not True]
    assert not failures, f"{len(failures)} of {len(results)} honest exact-token verifications failed: {failures}"


def test_chat_form_round_trips_verify(roundtrips, tokenizer) -> None:
    """Chat responses verified as messages + {"role": "assistant", "content": reply}."""
    results = _results(roundtrips, "chat")
    assert len(results) >= 14
    failures = []
    checked = 0
    for r in results:
        sample = r["sample"]
        generated = sample["output_ids"][:-1] if sample["finish_reason"] == "stop" else sample["output_ids"]
        retokenized = tokenizer.encode(sample["text"], add_special_tokens=False)
        checked += retokenized == generated
        if r["report"].get("verified") is True:
            continue
        if retokenized != generated:
            # the reply text does not re-tokenize to the generated tokens, so the chat form cannot
            # line its rows up: refused (400) when the in-context token count differs from the
            # fingerprint's, not verified when only the tokens differ (docs/verification.md)
            continue
        failures.append({**_failure(r), "reply_retokenizes_to_generated_tokens": retokenized == generated,
                         "generated_tokens": len(generated), "retokenized_tokens": len(retokenized)})
    assert not failures, f"{len(failures)} of {len(results)} honest chat-form verifications failed: {failures}"
    assert checked >= len(results) // 2, f"only {checked} of {len(results)} replies re-tokenize to their tokens"


def test_greedy_responses_are_greedy_consistent(roundtrips) -> None:
    """Exact-token verifications of temperature-0 responses: every response token is the argmax
    of the verifier's prefill (expect_greedy was set, so this is also part of `verified`)."""
    greedy = [r for r in _results(roundtrips, "tokens") if r["greedy"]]
    assert len(greedy) >= 28
    bad = []
    for r in greedy:
        rep, n = r["report"], len(r["sample"]["output_ids"])
        ok = (rep.get("greedy_consistent") is True and rep.get("expect_greedy") is True
              and rep.get("argmax_matches") == rep.get("argmax_checked") == n)
        if not ok:
            bad.append((r["case"], n, rep.get("argmax_checked"), rep.get("argmax_matches"), stats(rep)))
    assert not bad, bad


def test_reports_describe_the_response(roundtrips) -> None:
    for r in _results(roundtrips, "tokens"):
        rep, sample = r["report"], r["sample"]
        n = len(sample["output_ids"])
        assert rep["response_tokens"] == n, (r["case"], rep)
        assert rep["response_start"] == len(sample["input_ids"]), (r["case"], rep)
        assert len(rep["chunks"]) == chunks_for(n), (r["case"], rep)
        assert len(rep["response_token_logprobs"]) == n
        assert all(lp is not None and lp <= 0.0 for lp in rep["response_token_logprobs"])
        assert rep["exp_mismatches"] == max(c["exp_mismatches"] for c in rep["chunks"])
        assert rep["mant_err_mean"] == max(c["mant_err_mean"] for c in rep["chunks"])
        assert rep["fingerprint_verified"] is True
    for r in _results(roundtrips, "chat"):
        rep, sample = r["report"], r["sample"]
        if "refused" in rep:
            continue  # justified refusals are checked in test_chat_form_round_trips_verify
        assert rep["response_tokens"] == len(sample["output_ids"]), (r["case"], rep)
        assert len(rep["chunks"]) == chunks_for(len(sample["output_ids"]))


def test_fingerprints_have_one_proof_per_32_tokens(roundtrips) -> None:
    seen_chunks = set()
    for rt in roundtrips:
        for sample in rt["samples"]:
            n = len(sample["output_ids"])
            assert n >= 1
            assert len(sample["all_fingerprints"]) >= 1
            fp = decode(sample["fingerprint"])
            assert (fp.topk, fp.chunk_size, fp.n_rows) == (128, 32, n), (rt["case"]["id"], fp.n_rows, n)
            assert len(fp.proofs) == fp.num_chunks == chunks_for(n)
            seen_chunks.add(fp.num_chunks)
    assert {1, 2, 3} <= seen_chunks  # 1..32, 33..64 and 65..70 tokens all occurred


def test_coverage_of_the_case_mix(roundtrips) -> None:
    """The mix really contains what the round trip claims to cover."""
    samples = [s for rt in roundtrips for s in rt["samples"]]
    finishes = {s["finish_reason"] for s in samples}
    lengths = [len(s["input_ids"]) for s in samples]
    outs = [len(s["output_ids"]) for s in samples]
    eos_stops = sum(s["finish_reason"] == "stop" for s in samples)
    record("roundtrip_coverage", samples=len(samples), eos_stops=eos_stops,
           length_stops=sum(s["finish_reason"] == "length" for s in samples),
           prompt_len_min=min(lengths), prompt_len_max=max(lengths),
           output_len_min=min(outs), output_len_max=max(outs))
    assert {"stop", "length"} <= finishes
    assert eos_stops >= 3
    assert min(lengths) == 1 and max(lengths) >= 300
    assert min(outs) == 1 and max(outs) == 70
    assert sum(rt["case"]["n"] == 2 for rt in roundtrips) == 4
    assert {(s["endpoint"], s["stream"]) for s in samples} == set(ENDPOINTS)


def test_chat_form_refuses_reply_whose_text_retokenizes_differently(toploc_server, tokenizer) -> None:
    """SmolLM2 greedily emits the single token "\\n\\n" (1116) before "2.", but the text
    "\\n\\n2." re-tokenizes as "\\n", "\\n", "2", ".": the chat form cannot align such a reply,
    so the server must say so (400 naming the exact-token form) instead of reporting a failed
    verification; the exact-token form verifies the same response."""
    messages = [{"role": "user", "content": "List five animals that live in the ocean."}]
    [sample] = gen_chat(toploc_server.url, messages, max_tokens=70, temperature=0.0)
    generated = sample["output_ids"][:-1] if sample["finish_reason"] == "stop" else sample["output_ids"]
    retokenized = tokenizer.encode(sample["text"], add_special_tokens=False)
    assert tokenizer.decode(generated) == sample["text"]
    exact = verify_sample(toploc_server.url, sample, "tokens", expect_greedy=True)
    chat = verify_sample(toploc_server.url, sample, "chat", expect_greedy=True)
    record("chat_form_retokenization_repro", generated_tokens=len(generated), retokenized_tokens=len(retokenized),
           same_tokens=retokenized == generated, exact_form=stats(exact), chat_form=stats(chat))
    assert exact["verified"] is True
    assert len(retokenized) != len(generated)
    assert "exact-token form" in chat.get("refused", ""), chat


def test_logprob_requests_finishing_among_others_keep_their_logprobs_and_fingerprints(toploc_server) -> None:
    """A finishing request's output is held until its last proofs are built, then goes out with a
    later batch's outputs. Requests that ask for output log-probs finish at staggered steps among
    longer requests that do not: each must come back with its own log-probs (one per token) and a
    fingerprint that verifies, and the others with neither log-probs nor a foreign fingerprint.
    (Which batch carries a released output depends on timing; test_output_hold.py pins the case
    of a batch without log-prob requests.)"""
    from toploc_helpers import assert_fingerprints_verify, post

    url = toploc_server.url
    rng = random.Random(5)
    prompts = [[rng.randint(200, 40000) for _ in range(8 + 3 * i)] for i in range(12)]

    def job(i: int) -> dict:
        logprobs = i % 2 == 0
        body = {
            "input_ids": prompts[i],
            "sampling_params": {"max_new_tokens": (3 + 2 * i) if logprobs else 48, "temperature": 0,
                                "ignore_eos": True},
            "return_logprob": logprobs, "return_input_ids": True, "return_output_ids": True,
        }
        resp = post(url, "/generate", body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        return {"logprobs": logprobs, "max": body["sampling_params"]["max_new_tokens"], **out["meta_info"]}

    metas = pmap(job, range(12), workers=12)
    for meta in metas:
        assert len(meta["output_ids"]) == meta["max"] == meta["completion_tokens"]
        if meta["logprobs"]:
            assert len(meta["output_token_logprobs"]) == meta["max"], meta.get("output_token_logprobs")
            assert [tok for _, tok, _ in meta["output_token_logprobs"]] == meta["output_ids"]
        else:
            assert not meta.get("output_token_logprobs")
    assert_fingerprints_verify(url, metas)
