"""TOPLOC metrics and log lines of a real --enable-metrics server.

One generation, one honest and one tampered verification and one malformed fingerprint move the
sglang_rl_toploc_* series of `GET /metrics` by exactly those amounts; the server's log has the
load line, the uncalibrated-bounds warning and the failed verification with its request id.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter

import requests
from prometheus_client.parser import text_string_to_metric_families

from toploc_helpers import RESULT_FIELD, TIMEOUT, gen_generate, post

P = "sglang_rl_toploc_"
STATISTICS = ("exp_mismatches", "mant_err_mean", "mant_err_median")



def scrape(url: str) -> dict[tuple, float]:
    """Every sample of GET /metrics, keyed by (name, sorted labels)."""
    resp = requests.get(url + "/metrics", timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def verify(url: str, ids: list[int], fingerprint: str, rid: str) -> dict:
    body = {"rid": rid, "input_ids": ids, "sampling_params": {"max_new_tokens": 0},
            "toploc_verification_fingerprint_to_validate": fingerprint}
    resp = post(url, "/generate", body)
    assert resp.status_code == 200, resp.text
    return json.loads(resp.json()["meta_info"][RESULT_FIELD])


def label(report: dict) -> str:
    """The documented verdict label of a report without an error."""
    return report.get("verdict") or ("pass" if report["verified"] else "fail")


def test_series_move_by_the_requests_and_failures_are_logged(toploc_server, tokenizer) -> None:
    url = toploc_server.url
    tag = uuid.uuid4().hex[:8]
    before = scrape(url)
    assert (f"{P}invalid_fingerprints_total", ()) in before  # exported from the start

    prompt = tokenizer.encode("The history of the printing press begins in", add_special_tokens=False)
    [sample] = gen_generate(url, input_ids=prompt, max_tokens=40, ignore_eos=True)
    honest = verify(url, sample["input_ids"] + sample["output_ids"], sample["fingerprint"], f"honest-{tag}")
    other = tokenizer.encode("Once upon a time, in a small village by the sea,", add_special_tokens=False)
    tampered = verify(url, other + sample["output_ids"], sample["fingerprint"], f"tampered-{tag}")
    malformed = post(url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0},
                                        "toploc_verification_fingerprint_to_validate": "not-a-fingerprint"})
    after = scrape(url)

    assert honest["verified"] is True and tampered["verified"] is False, (honest, tampered)
    assert malformed.status_code == 400 and "invalid toploc_verification_fingerprint_to_validate" in malformed.text
    assert delta(before, after, f"{P}fingerprints_built_total") == 1
    assert delta(before, after, f"{P}invalid_fingerprints_total") == 1
    moved = {dict(labels)["verdict"]: after[(name, labels)] - before.get((name, labels), 0.0)
             for name, labels in after if name == f"{P}verifications_total"}
    assert {verdict: n for verdict, n in moved.items() if n} == dict(Counter([label(honest), label(tampered)])), moved
    assert delta(before, after, f"{P}verification_seconds_count") == 2
    assert delta(before, after, f"{P}verification_seconds_sum") > 0
    for stat in STATISTICS:
        assert delta(before, after, f"{P}{stat}_count") == 2, stat
        assert abs(delta(before, after, f"{P}{stat}_sum") - (honest[stat] + tampered[stat])) < 1e-3, stat

    log = toploc_server.log_path.read_text(errors="replace")
    assert "sglang-rl 0.1.0 loaded" in log and "TOPLOC metrics on" in log
    assert "TOPLOC verification runs with uncalibrated defaults" in log
    failed = [line for line in log.splitlines() if "TOPLOC verification failed" in line]
    assert any(f"rid=tampered-{tag} " in line for line in failed), failed
    assert not any(f"honest-{tag}" in line for line in failed), failed
