"""The server is not trusted: an independent transformers forward is the oracle.

For several real responses, the last-layer (post final norm) hidden states are recomputed with a
plain `AutoModelForCausalLM` forward in float32 over input_ids + output_ids[:-1]; rows
L-1 .. L+n-2 are the lm_head inputs that produced the n response tokens. Then:
- toploc itself (its C++ verifier) accepts the server's proofs against the HF rows;
- the HF rows' argmax through the tied lm_head gives the server's greedy tokens;
- proofs built from the HF rows (sglang_rl.fingerprint.build_fingerprint) verify on the server,
  and proofs of the wrong rows (shifted by one position) do not.
"""

from __future__ import annotations

import pytest
import torch

from sglang_rl.fingerprint import decode_fingerprint, encode_fingerprint
from sglang_rl.fingerprint.codec import build_fingerprint
from toploc_helpers import gen_chat, gen_generate, pmap, record, verify_tokens

# the TOPLOC authors' acceptance bounds, per chunk
MAX_EXP_MISMATCHES_HONEST = 5
MAX_MANT_ERR_MEAN = 10.0
MAX_MANT_ERR_MEDIAN = 8.0


@pytest.fixture(scope="module")
def samples(toploc_server, tokenizer) -> list[dict]:
    url = toploc_server.url
    story = tokenizer.encode("Once upon a time, in a small village by the sea, there lived ", add_special_tokens=False)
    code = tokenizer.encode("def add(a, b):\n    return a + b\n\n" * 12, add_special_tokens=False)
    jobs = [
        lambda: gen_generate(url, input_ids=story, max_tokens=70, temperature=0.0, ignore_eos=True),
        lambda: gen_generate(url, input_ids=code[:200], max_tokens=40, temperature=0.0, stream=True),
        lambda: gen_generate(url, input_ids=story[:1], max_tokens=33, temperature=0.0, ignore_eos=True),
        lambda: gen_generate(url, text="The three laws of motion are", max_tokens=64, temperature=0.8),
        lambda: gen_chat(url, [{"role": "user", "content": "Write a short poem about the moon."}],
                         max_tokens=50, temperature=0.0),
        lambda: gen_generate(url, input_ids=code[:9], max_tokens=5, temperature=0.0),
    ]
    return [s for group in pmap(lambda job: job(), jobs, workers=6) for s in group]


@pytest.fixture(scope="module")
def reference(samples, hf_model) -> list[dict]:
    """Per sample: the HF rows that produced the response, and rows one position later."""
    out = []
    for sample in samples:
        ids = sample["input_ids"] + sample["output_ids"]
        with torch.no_grad():
            full = hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        L, n = len(sample["input_ids"]), len(sample["output_ids"])
        # a causal model's rows do not depend on later tokens: one forward gives both
        out.append({"rows": full[L - 1 : L - 1 + n], "shifted": full[L : L + n]})
    return out


def test_toploc_accepts_server_proofs_against_hf_rows(samples, reference) -> None:
    table = []
    import toploc

    for sample, ref in zip(samples, reference):
        fp = decode_fingerprint(sample["fingerprint"], expected_topk=128)
        rows = ref["rows"]

        results = toploc.verify_proofs_bytes(rows.bfloat16(), list(fp.proofs), decode_batching_size=32,
                                             topk=128, skip_prefill=True)
        assert len(results) == fp.num_chunks
        for chunk, res in enumerate(results):
            table.append((len(sample["input_ids"]), len(sample["output_ids"]), chunk, res.exp_mismatches,
                          res.mant_err_mean, res.mant_err_median))
    record("oracle_hf_vs_server_proofs", chunks=len(table),
           worst_exp_mismatches=max(t[3] for t in table), worst_mant_err_mean=max(t[4] for t in table),
           worst_mant_err_median=max(t[5] for t in table))
    for prompt_len, n, chunk, exp, mean, median in table:
        assert exp <= MAX_EXP_MISMATCHES_HONEST, (prompt_len, n, chunk, exp, mean, median)
        assert mean <= MAX_MANT_ERR_MEAN and median <= MAX_MANT_ERR_MEDIAN, (prompt_len, n, chunk, mean, median)


def test_hf_argmax_reproduces_greedy_tokens(samples, reference, hf_model) -> None:
    """The rows are really the ones that produced the tokens: lm_head(rows).argmax == output."""
    total = agree = 0
    for sample, ref in zip(samples, reference):
        if sample["temperature"] != 0.0:
            continue
        rows = ref["rows"]
        with torch.no_grad():
            predicted = hf_model.lm_head(rows).argmax(-1).tolist()
        total += len(predicted)
        agree += sum(int(p == o) for p, o in zip(predicted, sample["output_ids"]))
    record("oracle_hf_greedy_agreement", agree=agree, total=total)
    assert total >= 100 and agree == total


def test_server_verifies_proofs_built_from_hf_rows(samples, reference, toploc_server) -> None:
    jobs = []
    for sample, ref in zip(samples, reference):
        ids = sample["input_ids"] + sample["output_ids"]
        own = encode_fingerprint(build_fingerprint(ref["rows"].bfloat16(), topk=128, chunk_size=32))
        jobs.append((ids, own, True))
        if ref["rows"].shape[0] >= 2:
            # proofs of the rows one position later (the wrong alignment) must not verify
            shifted = encode_fingerprint(build_fingerprint(ref["shifted"].bfloat16()))
            jobs.append((ids, shifted, False))
    outcomes = pmap(lambda job: (job, verify_tokens(toploc_server.url, job[0], job[1], via="generate")), jobs)
    honest = [rep for (ids, fp, good), (status, rep) in outcomes if good]
    wrong = [rep for (ids, fp, good), (status, rep) in outcomes if not good]
    assert all(status == 200 for _, (status, _) in outcomes), outcomes
    record("oracle_hf_built_proofs_on_server", honest_verified=sum(r["verified"] for r in honest),
           honest=len(honest), shifted_rejected=sum(not r["verified"] for r in wrong), shifted=len(wrong),
           worst_honest_exp_mismatches=max(r["exp_mismatches"] for r in honest))
    assert all(r["verified"] and r["exp_mismatches"] <= MAX_EXP_MISMATCHES_HONEST for r in honest), honest
    assert wrong and not any(r["verified"] for r in wrong), wrong
