"""The client side of TOPLOC verification over HTTP: ask a verifier server about one response.

Standard library only, so that scripts that collect or audit fingerprints need nothing else.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any, Sequence

FINGERPRINT_TO_VALIDATE = "toploc_verification_fingerprint_to_validate"
RESULT_FIELD = "toploc_verification_fingerprint_validation_result"


def post_generate(url: str, body: dict, timeout: float) -> Any:
    """POST `body` to `url`/generate and return the decoded JSON answer."""
    request = urllib.request.Request(url.rstrip("/") + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def verify_response(url: str, input_ids: Sequence[int], output_ids: Sequence[int], fingerprint: str,
                    timeout: float) -> dict:
    """The verifier's report for a response's fingerprint, in the exact-token form (prompt ids
    plus response ids prefilled, nothing generated)."""
    answer = post_generate(url, {"input_ids": list(input_ids) + list(output_ids),
                                 "sampling_params": {"max_new_tokens": 0},
                                 FINGERPRINT_TO_VALIDATE: fingerprint}, timeout)
    return json.loads(answer["meta_info"][RESULT_FIELD])
