"""Hidden states returned by generation requests: options, row selection, wire formats.

Engine-agnostic: nothing here imports sglang, so the same code validates a request, picks
its rows and encodes or decodes them on the server, in a trainer and in tests.
"""

from sglang_rl.hidden_states.packing import (
    SUPPORTED_DTYPES,
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

__all__ = [
    "SUPPORTED_DTYPES",
    "HiddenStatesFormat",
    "HiddenStatesMode",
    "HiddenStatesOptions",
    "HiddenStatesRequestError",
    "HiddenStatesScope",
    "available_positions",
    "decode_rows",
    "decode_rows_numpy",
    "encode_rows",
    "rows_to_list",
    "select_positions",
]
