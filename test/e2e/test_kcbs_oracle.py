"""k-CBS on a real CPU server equals the HF reference, on every entry point.

- 24 (prompt, k, T, final_prune) cases over 20 prompts (12 plain text, 8 chat turns, mostly
  yes/no questions the model answers in a few tokens, so beams finish on <|im_end|> and finished
  beams are carried next to live ones), covering k in
  {1, 2, 4, 8}, T in {1, 4, 16} (T=16 only for k <= 2) and both final-prune settings, all sent
  at once so the server batches the beams of many searches together: the candidates must equal
  `kcbs_reference` (same token lists in the same order, logprob and raw_logprob within 1e-4, same
  finish_reason), and the ordinary response fields must be the top-1 candidate;
- k=1 equals greedy decoding (a plain temperature-0 request with the same max_new_tokens, sent
  in a separate wave);
- defaults (k from top_k, T from max_new_tokens) and the sampling_params entry;
- the OpenAI client: /v1/completions and /v1/chat/completions with extra_body return
  kcbs_candidates on the choice (equal to the reference on the prompt ids the server used).
"""

from __future__ import annotations

import time

import pytest

from kcbs_helpers import (
    CHAT_PROMPTS,
    assert_candidates_match,
    flush_cache,
    generate,
    greedy_body,
    kcbs_body,
    oracle,
    pmap,
    prompt_ids,
    reference,
    shared_server,
    start_server_ahead,
)

pytestmark = pytest.mark.uses_servers("plain_server")  # through kcbs_helpers.shared_server

# (prompt, k, T, final_prune); chat prompts are the ones in CHAT_PROMPTS
CASES = [
    ("capital", 1, 1, True),
    ("fox", 1, 4, False),
    ("count", 1, 16, True),
    ("yes_no", 1, 16, False),
    ("fib", 2, 1, False),
    ("bread", 2, 4, True),
    ("fish", 2, 4, False),
    ("weather", 2, 16, True),
    ("snow", 2, 16, False),
    ("earth", 2, 16, True),
    ("planet", 4, 1, True),
    ("colour", 4, 1, False),
    ("numpy", 4, 4, True),
    ("fire", 4, 4, False),
    ("ice", 4, 4, True),
    ("yes_no", 4, 4, False),
    ("five", 4, 4, False),
    ("roses", 8, 1, False),
    ("sky", 8, 1, True),
    ("math", 8, 1, False),
    ("fish", 8, 4, False),
    ("earth", 8, 4, True),
    ("two_plus_two", 1, 4, True),
    ("capital", 2, 4, False),
]


def _case_id(case: tuple) -> str:
    name, k, steps, prune = case
    return f"{name}-k{k}-T{steps}-{'prune' if prune else 'all'}"


@pytest.fixture(scope="module")
def run(model_path):
    """Boot the server in the background, compute every reference meanwhile, then send all cases
    to the server concurrently."""
    start_server_ahead()
    t0 = time.time()
    o = oracle(model_path)
    tok = o["tokenizer"]
    refs = {}
    for case in CASES:
        name, k, steps, prune = case
        refs[case] = reference(model_path, prompt_ids(tok, name), k, steps, prune)
    t_ref = time.time() - t0
    server = shared_server()
    t1 = time.time()
    outs = pmap(lambda c: generate(server.url, kcbs_body(prompt_ids(tok, c[0]), c[1], c[2], c[3])), CASES)
    print(f"\n[kcbs-oracle] reference {t_ref:.1f}s ({o['model'].misses} forwards, {o['model'].calls} calls), "
          f"server {time.time() - t1:.1f}s for {len(CASES)} concurrent requests", flush=True)
    return {"server": server, "tok": tok, "refs": refs, "outs": dict(zip(CASES, outs))}


def test_case_grid_covers_the_brief():
    assert len(CASES) >= 20
    assert {c[1] for c in CASES} == {1, 2, 4, 8}
    assert {c[2] for c in CASES} == {1, 4, 16}
    assert {c[3] for c in CASES} == {True, False}
    assert all(c[1] <= 2 for c in CASES if c[2] == 16)
    assert len({c[0] for c in CASES}) >= 20


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_candidates_equal_reference(run, case):
    name, k, steps, prune = case
    out = run["outs"][case]
    meta = out["meta_info"]
    got = meta["kcbs_candidates"]
    want = run["refs"][case]
    assert_candidates_match(got, want, _case_id(case))
    if prune:
        assert len(got) <= k
    else:
        assert len(got) <= k * k
    # the ordinary fields are the top-1 candidate
    best = got[0]
    assert out["output_ids"] == best["token_ids"]
    assert out["text"] == best["text"]
    assert best["text"] == run["tok"].decode(best["token_ids"], skip_special_tokens=True)
    for c in got:
        assert c["text"] == run["tok"].decode(c["token_ids"], skip_special_tokens=True)
    assert meta["finish_reason"]["type"] == best["finish_reason"]
    assert meta["completion_tokens"] == len(best["token_ids"])
    # best first
    scores = [c["logprob"] for c in got]
    assert scores == sorted(scores, reverse=True)
    # the log-probs k-CBS asked for internally are not returned to a client that did not ask
    assert not [key for key in meta if "logprobs" in key], sorted(meta)


def test_finished_beams_are_exercised(run):
    """The grid really reaches EOS: some candidates end in 'stop', and some searches carry a
    finished beam next to live ones (shorter than T while others run to T)."""
    stops = 0
    carried = 0
    for case, want in run["refs"].items():
        reasons = {c["finish_reason"] for c in want}
        stops += sum(c["finish_reason"] == "stop" for c in want)
        if reasons == {"stop", "length"} and any(len(c["token_ids"]) < case[2] for c in want if c["finish_reason"] == "stop"):
            carried += 1
    print(f"\n[kcbs-oracle] stop candidates: {stops}, searches with finished and live beams: {carried}")
    assert stops >= 5 and carried >= 3


def test_k1_equals_greedy(run):
    """kcbs_beam_width=1 is greedy decoding: same tokens (EOS included) and text as a plain
    temperature-0 request of the same length, on text and chat prompts."""
    server, tok = run["server"], run["tok"]
    names = ["count", "yes_no", "say_hi", "fib"]
    jobs = [("kcbs", n) for n in names] + [("greedy", n) for n in names]

    def one(job):
        kind, name = job
        ids = prompt_ids(tok, name)
        if kind == "kcbs":
            return generate(server.url, kcbs_body(ids, 1, 16, True))
        return generate(server.url, greedy_body(ids, 16))

    # k-CBS and greedy requests are sent in two separate waves: sharing batches with ordinary
    # requests is test_kcbs_serving.test_mixed_batch_matches_alone's subject
    flush_cache(server.url)
    outs = dict(zip(jobs[:len(names)], pmap(one, jobs[:len(names)])))
    outs.update(zip(jobs[len(names):], pmap(one, jobs[len(names):])))
    stopped = 0
    for name in names:
        kc, gr = outs[("kcbs", name)], outs[("greedy", name)]
        cands = kc["meta_info"]["kcbs_candidates"]
        assert len(cands) == 1
        assert cands[0]["token_ids"] == gr["output_ids"], name
        assert kc["output_ids"] == gr["output_ids"] and kc["text"] == gr["text"], name
        assert kc["meta_info"]["finish_reason"]["type"] == gr["meta_info"]["finish_reason"]["type"], name
        assert cands[0]["finish_reason"] == gr["meta_info"]["finish_reason"]["type"], name
        stopped += gr["meta_info"]["finish_reason"]["type"] == "stop"
    assert stopped >= 1  # at least one greedy answer ends on EOS inside 16 tokens


def test_defaults_and_sampling_params_entry(run, model_path):
    """k defaults to top_k and T to max_new_tokens; the fields also work inside sampling_params."""
    server, tok = run["server"], run["tok"]
    ids = prompt_ids(tok, "two_plus_two")
    want = reference(model_path, ids, 3, 5, False)
    bodies = {
        "defaults": {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "top_k": 3},
                     "kcbs_enabled": True, "kcbs_final_prune": False},
        "in_sampling_params": {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 9, "kcbs_enabled": True, "kcbs_beam_width": 3, "kcbs_steps": 5,
            "kcbs_final_prune": False}},
        "defaults_in_sampling_params": {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 5, "top_k": 3, "temperature": 0.7, "kcbs_enabled": True,
            "kcbs_final_prune": False}},
    }
    outs = dict(zip(bodies, pmap(lambda b: generate(server.url, b), bodies.values())))
    for label, out in outs.items():
        assert_candidates_match(out["meta_info"]["kcbs_candidates"], want, label)


def test_openai_client_extra_body(run, model_path):
    """The OpenAI client path: completions and chat, k-CBS fields in extra_body; the candidates
    are on the choice (choices[i] / choices[i].message) and equal the reference on the prompt
    ids the server used (return_input_ids); the choice's text/content is the top-1 candidate."""
    from openai import OpenAI

    server, tok = run["server"], run["tok"]
    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=900, max_retries=0)
    extra = {"kcbs_enabled": True, "kcbs_beam_width": 4, "kcbs_steps": 4, "kcbs_final_prune": False,
             "return_input_ids": True}

    def completion():
        return client.completions.create(model="default", prompt="The Eiffel Tower is located in",
                                         max_tokens=4, extra_body=extra).model_dump()

    def chat():
        return client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": CHAT_PROMPTS["fire"]}],
            max_tokens=4, extra_body={**extra, "kcbs_beam_width": 2}).model_dump()

    comp, ch = pmap(lambda f: f(), [completion, chat])

    choice = comp["choices"][0]
    assert len(comp["choices"]) == 1
    cands = choice["kcbs_candidates"]
    assert choice["input_ids"] == tok("The Eiffel Tower is located in")["input_ids"]
    assert_candidates_match(cands, reference(model_path, choice["input_ids"], 4, 4, False), "completions")
    assert choice["text"] == cands[0]["text"]
    assert choice["finish_reason"] == cands[0]["finish_reason"]
    assert comp["usage"]["completion_tokens"] == len(cands[0]["token_ids"])

    msg = ch["choices"][0]["message"]
    assert len(ch["choices"]) == 1
    cands = msg["kcbs_candidates"]
    assert_candidates_match(cands, reference(model_path, msg["input_ids"], 2, 4, False), "chat")
    assert msg["content"] == cands[0]["text"]
    assert ch["choices"][0]["finish_reason"] == cands[0]["finish_reason"]
