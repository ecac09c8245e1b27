"""GSM8K reward for verl: 1.0 when the response's final number equals the reference answer.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` for each rollout
(`reward.custom_reward_function.path` points at this file). The final number is the one after the
last "####" when the response has one, else the last number in the response; "1,234", "$18" and
"18.0" all read as the number they write.
"""

from __future__ import annotations

import re
from typing import Any, Optional

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> Optional[float]:
    """The number a response ends its answer with (None if it writes none)."""
    tail = text.rsplit("####", 1)[-1] if "####" in text else text
    found = _NUMBER.findall(tail) or (_NUMBER.findall(text) if tail is not text else [])
    if not found:
        return None
    try:
        return float(found[-1].replace("$", "").replace(",", ""))
    except ValueError:
        return None


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: Optional[dict] = None, **_: Any) -> float:
    answer, reference = final_number(solution_str), final_number(str(ground_truth))
    return float(answer is not None and reference is not None and abs(answer - reference) < 1e-6)
