"""Hidden-state request options, row selection and wire encodings (CPU, real tensors)."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
import torch

from sglang_rl.hidden_states import (
    HiddenStatesFormat,
    HiddenStatesMode,
    HiddenStatesOptions,
    HiddenStatesRequestError,
    HiddenStatesScope,
    available_positions,
    decode_rows,
    decode_rows_numpy,
    encode_rows,
    rows_to_list,
    select_positions,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rows(n: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, hidden, generator=gen) * 3.0
    rows[0, :3] = torch.tensor([0.0, -0.0, 1e-3])
    return rows.to(dtype)


# --- options -----------------------------------------------------------------------------


def test_defaults_and_modes() -> None:
    off = HiddenStatesOptions.from_request()
    assert off.mode is HiddenStatesMode.NONE and not off.enabled
    assert off.format is HiddenStatesFormat.LIST and off.scope is HiddenStatesScope.ALL
    assert HiddenStatesOptions.from_request(None).mode is HiddenStatesMode.NONE
    full = HiddenStatesOptions.from_request(True)
    assert full.mode is HiddenStatesMode.FULL and full.enabled
    last = HiddenStatesOptions.from_request("last", "base64", "response")
    assert last.mode is HiddenStatesMode.LAST
    assert last.format is HiddenStatesFormat.BASE64
    assert last.scope is HiddenStatesScope.RESPONSE
    n = HiddenStatesOptions.from_request(True, "base64", "last_n", 7, True)
    assert n.scope is HiddenStatesScope.LAST_N and n.last_n == 7 and n.final_row
    t = HiddenStatesOptions.from_request(True, "tensor", allow_tensor_format=True)
    assert t.format is HiddenStatesFormat.TENSOR


LAST_N = {"return_hidden_states": True, "hidden_states_scope": "last_n"}


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"return_hidden_states": "full"}, "return_hidden_states"),
        ({"return_hidden_states": 1}, "return_hidden_states"),
        ({"return_hidden_states": "LAST"}, "return_hidden_states"),
        ({"return_hidden_states": True, "hidden_states_format": "json"}, "hidden_states_format"),
        ({"return_hidden_states": True, "hidden_states_format": "BASE64"}, "_format"),
        ({"return_hidden_states": True, "hidden_states_format": "tensor"}, "in-process Engine"),
        ({"return_hidden_states": True, "hidden_states_scope": "prompt"}, "hidden_states_scope"),
        (LAST_N, "requires"),
        ({**LAST_N, "hidden_states_last_n": 0}, "positive"),
        ({**LAST_N, "hidden_states_last_n": -3}, "positive"),
        ({**LAST_N, "hidden_states_last_n": 2.0}, "integer"),
        ({**LAST_N, "hidden_states_last_n": "4"}, "integer"),
        ({**LAST_N, "hidden_states_last_n": True}, "integer"),
        ({"return_hidden_states": True, "hidden_states_last_n": 4}, "set the scope to 'last_n'"),
        (
            {"return_hidden_states": True, "hidden_states_scope": "all", "hidden_states_last_n": 4},
            "set the scope",
        ),
        ({"return_hidden_states": False, "hidden_states_format": "xml"}, "hidden_states_format"),
        ({"return_hidden_states": True, "return_final_hidden_state": "yes"}, "final_hidden"),
    ],
)
def test_invalid_options_are_refused(kwargs: dict, fragment: str) -> None:
    with pytest.raises(HiddenStatesRequestError, match=fragment):
        HiddenStatesOptions.from_request(**kwargs)
    assert issubclass(HiddenStatesRequestError, ValueError)


# --- positions ---------------------------------------------------------------------------


def _opts(mode: bool | str, scope: str | None = None, n: int | None = None) -> HiddenStatesOptions:
    return HiddenStatesOptions.from_request(mode, None, scope, n)


def test_available_positions_off_by_one_and_final_row() -> None:
    assert list(available_positions(3, 4, False)) == [0, 1, 2, 3, 4, 5]
    assert list(available_positions(3, 4, True)) == [0, 1, 2, 3, 4, 5, 6]
    assert list(available_positions(3, 0, False)) == [0, 1]
    assert list(available_positions(0, 0, False)) == []
    with pytest.raises(ValueError):
        available_positions(-1, 2, False)


@pytest.mark.parametrize(
    "mode, scope, n, final, expected",
    [
        (True, "all", None, False, [0, 1, 2, 3, 4, 5]),
        (True, "all", None, True, [0, 1, 2, 3, 4, 5, 6]),
        (True, "response", None, False, [3, 4, 5]),
        (True, "response", None, True, [3, 4, 5, 6]),
        (True, "last_n", 2, False, [4, 5]),
        (True, "last_n", 2, True, [5, 6]),
        (True, "last_n", 100, False, [0, 1, 2, 3, 4, 5]),
        ("last", "all", None, False, [5]),
        ("last", "all", None, True, [6]),
        ("last", "response", None, False, [5]),
        ("last", "last_n", 3, True, [6]),
        (False, "all", None, True, []),
    ],
)
def test_select_positions(mode, scope, n, final, expected) -> None:
    # prompt_len=3, output_len=4: tokens 0..6, the last sampled token (6) has a row only
    # when the engine ran the extra final forward pass.
    assert select_positions(3, 4, _opts(mode, scope, n), has_final_row=final) == expected


def test_response_scope_counts_and_empty_response() -> None:
    full_resp = _opts(True, "response")
    for prompt_len, output_len in [(1, 1), (5, 1), (5, 9), (17, 300)]:
        got = select_positions(prompt_len, output_len, full_resp, has_final_row=False)
        assert len(got) == output_len - 1
        assert all(p >= prompt_len for p in got)
        got_final = select_positions(prompt_len, output_len, full_resp, has_final_row=True)
        assert len(got_final) == output_len and got_final[-1] == prompt_len + output_len - 1
    assert select_positions(5, 1, _opts("last", "response"), has_final_row=False) == []
    assert select_positions(5, 0, full_resp, has_final_row=False) == []


# --- encodings ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_base64_round_trip_matches_list(dtype: torch.dtype) -> None:
    rows = _rows(9, 24, dtype)
    positions = list(range(10, 19))
    payload = encode_rows(rows, positions)
    assert payload["dtype"] == str(dtype).removeprefix("torch.")
    assert payload["shape"] == [9, 24]
    assert payload["positions"] == positions
    json.loads(json.dumps(payload))

    decoded, got_positions = decode_rows(payload)
    assert decoded.dtype == dtype and decoded.shape == rows.shape
    assert torch.equal(decoded.view(torch.uint8), rows.view(torch.uint8))
    assert got_positions == positions
    assert rows_to_list(decoded) == rows_to_list(rows)

    array, np_positions = decode_rows_numpy(payload)
    assert np_positions == positions
    expected_np_dtype = np.float16 if dtype is torch.float16 else np.float32
    assert array.dtype == expected_np_dtype
    np.testing.assert_array_equal(array.astype(np.float32), decoded.float().numpy())
    assert array.astype(np.float64).tolist() == rows_to_list(rows)


def test_raw_bytes_are_little_endian_c_order() -> None:
    rows = torch.tensor([[1.0, 2.0], [3.0, -4.0]], dtype=torch.float32).t()
    assert not rows.is_contiguous()
    raw = base64.b64decode(encode_rows(rows, [0, 1])["data"])
    assert raw == np.array([[1.0, 3.0], [2.0, -4.0]], dtype="<f4").tobytes()
    bf = torch.tensor([[1.0, -2.0]], dtype=torch.bfloat16)
    assert base64.b64decode(encode_rows(bf, [5])["data"]) == bytes([0x80, 0x3F, 0x00, 0xC0])


@pytest.mark.parametrize(
    "dtype, itemsize", [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)]
)
def test_payload_sizes(dtype: torch.dtype, itemsize: int) -> None:
    n, hidden = 64, 256
    rows = _rows(n, hidden, dtype, seed=1)
    payload = encode_rows(rows, list(range(n)))
    raw_bytes = n * hidden * itemsize
    assert len(payload["data"]) == 4 * math.ceil(raw_bytes / 3)
    assert len(base64.b64decode(payload["data"])) == raw_bytes
    list_chars = len(json.dumps(rows_to_list(rows)))
    assert len(json.dumps(payload)) * 3 < list_chars


def test_empty_rows_round_trip() -> None:
    rows = torch.zeros(0, 8, dtype=torch.bfloat16)
    payload = encode_rows(rows, [])
    decoded, positions = decode_rows(payload)
    assert decoded.shape == (0, 8) and positions == []
    assert decode_rows_numpy(payload)[0].shape == (0, 8)


def test_encode_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="positions"):
        encode_rows(torch.zeros(3, 4), [0, 1])
    with pytest.raises(ValueError, match="non-negative"):
        encode_rows(torch.zeros(2, 4), [0, -1])
    with pytest.raises(ValueError, match="2-D"):
        encode_rows(torch.zeros(4), [0])
    with pytest.raises(ValueError, match="unsupported dtype"):
        encode_rows(torch.zeros(2, 4, dtype=torch.float64), [0, 1])


def test_decode_validates_payload() -> None:
    good = encode_rows(_rows(4, 6, torch.bfloat16), [3, 4, 5, 6])
    bad_cases = [
        ({**good, "positions": [3, 4, 5]}, "positions given for 4 rows"),
        ({**good, "shape": [4, 7]}, "bytes"),
        ({**good, "shape": [5, 6]}, "positions given for 5 rows"),
        ({**good, "shape": [4]}, "shape"),
        ({**good, "shape": [4, -6]}, "shape"),
        ({**good, "dtype": "int8"}, "unsupported dtype"),
        ({**good, "data": good["data"][:-4]}, "bytes"),
        ({**good, "data": "!!" + good["data"][2:]}, "base64"),
        ({k: v for k, v in good.items() if k != "positions"}, "lacks"),
    ]
    for payload, fragment in bad_cases:
        with pytest.raises(ValueError, match=fragment):
            decode_rows(payload)
        with pytest.raises(ValueError, match=fragment):
            decode_rows_numpy(payload)
