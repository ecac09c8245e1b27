"""Request options, row selection and wire encodings for returned hidden states.

Vocabulary used throughout:

* A request's token sequence is ``input_ids + output_ids`` (prompt first), indexed by
  *position* ``p`` from 0.
* The *row* at position ``p`` is the last-layer hidden state (the lm_head input) computed
  with token ``p`` as the model's input. Its lm_head output is the distribution that
  token ``p + 1`` was sampled from.
* The last sampled token is never fed back into the model, so rows normally exist for
  positions ``0 .. prompt_len + output_len - 2``. An engine that runs one extra forward
  pass on it (``return_final_hidden_state``) also has the row at
  ``prompt_len + output_len - 1``.

Positions travel with every binary payload, so a consumer never has to infer which
token a row belongs to (which is what goes wrong with left padding, radix-cache hits and
chunked prefill when only a bare list of rows is returned).
"""

from __future__ import annotations

import base64
import binascii
import enum
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

try:  # SIMD base64 (a dependency of sglang): ~14x faster than the standard library on MB payloads
    import pybase64 as _b64
except ImportError:  # pragma: no cover - plain torch installs without sglang
    _b64 = base64

__all__ = [
    "HiddenStatesRequestError",
    "HiddenStatesMode",
    "HiddenStatesFormat",
    "HiddenStatesScope",
    "HiddenStatesOptions",
    "available_positions",
    "select_positions",
    "encode_rows",
    "decode_rows",
    "decode_rows_numpy",
    "rows_to_list",
    "SUPPORTED_DTYPES",
]


class HiddenStatesRequestError(ValueError):
    """A request asked for hidden states with an invalid combination of options."""


class HiddenStatesMode(str, enum.Enum):
    """How many rows a request wants: none, all of its scope, or only the last one."""

    NONE = "none"
    FULL = "full"
    LAST = "last"


class HiddenStatesFormat(str, enum.Enum):
    """How rows are delivered.

    ``list`` is upstream sglang's nested-float format, ``base64`` the compact binary
    payload of :func:`encode_rows`, and ``tensor`` hands back a CPU tensor, which only
    makes sense when the caller lives in the same process (the offline Engine).
    """

    LIST = "list"
    BASE64 = "base64"
    TENSOR = "tensor"


class HiddenStatesScope(str, enum.Enum):
    """Which positions are candidates for delivery (see :func:`select_positions`)."""

    ALL = "all"
    RESPONSE = "response"
    LAST_N = "last_n"


_FORMATS = {f.value: f for f in HiddenStatesFormat}
_SCOPES = {s.value: s for s in HiddenStatesScope}


def _choice(name: str, value: Any, choices: Mapping[str, Any], default: Any) -> Any:
    """The member a request's string field names (`default` when not given)."""
    if value is None:
        return default
    if isinstance(value, str) and value in choices:
        return choices[value]
    raise HiddenStatesRequestError(f"unknown {name} {value!r}; expected one of {sorted(choices)}")


def _is_int(value: Any) -> bool:
    """True for real integers; bools are rejected even though Python treats them as ints."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class HiddenStatesOptions:
    """Validated per-request hidden-state options.

    Build it with :meth:`from_request` so every field has been checked once, at the
    edge, rather than wherever the options are used.
    """

    mode: HiddenStatesMode = HiddenStatesMode.NONE
    format: HiddenStatesFormat = HiddenStatesFormat.LIST
    scope: HiddenStatesScope = HiddenStatesScope.ALL
    last_n: int | None = None
    final_row: bool = False

    @property
    def enabled(self) -> bool:
        """Whether the request wants any rows at all."""
        return self.mode is not HiddenStatesMode.NONE

    @classmethod
    def from_request(
        cls,
        return_hidden_states: bool | str | None = False,
        hidden_states_format: str | None = None,
        hidden_states_scope: str | None = None,
        hidden_states_last_n: int | None = None,
        return_final_hidden_state: bool | None = False,
        *,
        allow_tensor_format: bool = False,
    ) -> "HiddenStatesOptions":
        """Parse and validate the raw request fields.

        ``return_hidden_states`` is ``True`` (all rows of the scope), ``"last"`` (only the
        last row of the scope) or ``False``/``None`` (nothing). ``None`` for any other
        field means "not given" and selects the default (format ``list``, scope ``all``).
        Values are validated even when hidden states are off, so a typo never hides until
        the day the feature is switched on. ``allow_tensor_format`` is set only by the
        in-process Engine path; over HTTP a tensor cannot be delivered.

        Raises:
            HiddenStatesRequestError: for any invalid value or combination.
        """
        if return_hidden_states is None or return_hidden_states is False:
            mode = HiddenStatesMode.NONE
        elif return_hidden_states is True:
            mode = HiddenStatesMode.FULL
        elif isinstance(return_hidden_states, str) and return_hidden_states == "last":
            mode = HiddenStatesMode.LAST
        else:
            raise HiddenStatesRequestError(
                f"return_hidden_states must be true, false or \"last\", "
                f"got {return_hidden_states!r}"
            )

        fmt = _choice("hidden_states_format", hidden_states_format, _FORMATS, HiddenStatesFormat.LIST)
        if fmt is HiddenStatesFormat.TENSOR and not allow_tensor_format:
            raise HiddenStatesRequestError(
                "hidden_states_format 'tensor' is only available to the in-process Engine; "
                "use 'base64' (or 'list') over HTTP"
            )

        scope = _choice("hidden_states_scope", hidden_states_scope, _SCOPES, HiddenStatesScope.ALL)

        if scope is HiddenStatesScope.LAST_N:
            if hidden_states_last_n is None:
                raise HiddenStatesRequestError(
                    "hidden_states_scope 'last_n' requires hidden_states_last_n"
                )
            if not _is_int(hidden_states_last_n):
                raise HiddenStatesRequestError(
                    f"hidden_states_last_n must be an integer, got "
                    f"{type(hidden_states_last_n).__name__} {hidden_states_last_n!r}"
                )
            if hidden_states_last_n <= 0:
                raise HiddenStatesRequestError(
                    f"hidden_states_last_n must be positive, got {hidden_states_last_n}"
                )
            last_n: int | None = int(hidden_states_last_n)
        else:
            if hidden_states_last_n is not None:
                raise HiddenStatesRequestError(
                    f"hidden_states_last_n={hidden_states_last_n!r} was given but "
                    f"hidden_states_scope is {scope.value!r}; set the scope to 'last_n'"
                )
            last_n = None

        if return_final_hidden_state is None:
            final_row = False
        elif isinstance(return_final_hidden_state, bool):
            final_row = return_final_hidden_state
        else:
            raise HiddenStatesRequestError(
                f"return_final_hidden_state must be a boolean, got {return_final_hidden_state!r}"
            )

        return cls(mode=mode, format=fmt, scope=scope, last_n=last_n, final_row=final_row)


def _check_count(name: str, value: Any) -> int:
    """Validate a non-negative token count."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def available_positions(prompt_len: int, output_len: int, has_final_row: bool) -> range:
    """Positions for which the engine has a row (see the module docstring)."""
    prompt_len = _check_count("prompt_len", prompt_len)
    output_len = _check_count("output_len", output_len)
    total = prompt_len + output_len
    end = total if has_final_row else total - 1
    return range(0, max(end, 0))


def select_positions(
    prompt_len: int,
    output_len: int,
    options: HiddenStatesOptions,
    has_final_row: bool,
) -> list[int]:
    """Positions (into ``input_ids + output_ids``) whose rows are delivered, ascending.

    Scopes:

    * ``all``: every available row.
    * ``response``: rows whose *input token is a response token*, i.e. positions
      ``prompt_len .. end``. The row at ``prompt_len - 1`` (the one the first response
      token was sampled from) is deliberately excluded because (1) a row is named by its
      input token everywhere in this package, so "response rows" line up one-to-one with
      the response columns of an RL batch (the same columns verl's response mask covers);
      (2) every response row comes from a decode/verify forward pass, so the prefill's
      rows, which radix-cache hits and chunked prefill are known to drop or shift, are
      never needed; (3) the count is ``output_len - 1`` (``output_len`` with the final
      row), independent of how the prompt was prefilled. A caller who also wants the
      row at ``prompt_len - 1`` can ask for ``all`` or ``last_n``.
    * ``last_n``: the last ``N`` available rows (all of them when fewer exist).

    Mode ``last`` returns only the last position of the chosen scope (an empty list if
    the scope is empty, e.g. ``response`` scope with a single output token and no final
    row). Mode ``none`` returns ``[]``.
    """
    rows = available_positions(prompt_len, output_len, has_final_row)
    if not options.enabled or len(rows) == 0:
        return []
    if options.scope is HiddenStatesScope.ALL:
        chosen = rows
    elif options.scope is HiddenStatesScope.RESPONSE:
        chosen = range(max(prompt_len, rows.start), rows.stop)
    else:
        if options.last_n is None:
            raise HiddenStatesRequestError("scope 'last_n' without last_n; use from_request")
        chosen = range(max(rows.stop - options.last_n, rows.start), rows.stop)
    if options.mode is HiddenStatesMode.LAST:
        chosen = chosen[-1:]
    return list(chosen)


# Wire dtype name -> (torch dtype, little-endian numpy dtype of the same width, used to
# move the raw bits; bfloat16 travels as int16 because numpy has no bfloat16).
SUPPORTED_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "bfloat16": (torch.bfloat16, "<i2"),
    "float16": (torch.float16, "<f2"),
    "float32": (torch.float32, "<f4"),
}
_TORCH_TO_NAME = {torch_dtype: name for name, (torch_dtype, _) in SUPPORTED_DTYPES.items()}
_BIT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.float16,
    torch.float32: torch.float32,
}


def host_view(rows: torch.Tensor) -> np.ndarray:
    """Rows as a host numpy array holding the same bytes (bfloat16, which numpy lacks, as int16):
    a view when the rows are already on the host and contiguous."""
    return rows.detach().to("cpu").contiguous().view(_BIT_VIEW[rows.dtype]).numpy()


def _check_positions(positions: Sequence[int], n_rows: int) -> list[int]:
    """Validate that positions are non-negative ints, one per row."""
    out = []
    for p in positions:
        if not _is_int(p) or p < 0:
            raise ValueError(f"positions must be non-negative integers, got {p!r}")
        out.append(int(p))
    if len(out) != n_rows:
        raise ValueError(f"{len(out)} positions given for {n_rows} rows")
    return out


def _b64_text(data: Any) -> str:
    """Base64 of a buffer as str (pybase64 builds the str directly, without an ASCII bytes copy)."""
    as_string = getattr(_b64, "b64encode_as_string", None)
    return as_string(data) if as_string is not None else _b64.b64encode(data).decode("ascii")


def encode_rows(rows: torch.Tensor, positions: Sequence[int]) -> dict[str, Any]:
    """Encode ``rows`` ``[n, H]`` as a JSON-safe dict with base64 raw bytes.

    The bytes are the tensor's little-endian, C-contiguous element bits, so a bf16 row
    costs 2 bytes per value (about 2.7 characters of base64) instead of ~20 characters as
    a Python float in a JSON list, and decoding is a single ``frombuffer``.
    """
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError(f"rows must be a 2-D tensor [n, H], got {getattr(rows, 'shape', rows)!r}")
    name = _TORCH_TO_NAME.get(rows.dtype)
    if name is None:
        raise ValueError(
            f"unsupported dtype {rows.dtype}; expected one of {sorted(SUPPORTED_DTYPES)}"
        )
    pos = _check_positions(positions, rows.shape[0])
    wire = SUPPORTED_DTYPES[name][1]
    raw = np.ascontiguousarray(host_view(rows).astype(wire, copy=False))
    return {
        "dtype": name,
        "shape": [int(rows.shape[0]), int(rows.shape[1])],
        "data": _b64_text(raw.data),
        "positions": pos,
    }


def _decode_bits(obj: Mapping[str, Any]) -> tuple[np.ndarray, str, list[int]]:
    """Validate a payload and return its raw elements as a native-endian ``[n, H]`` array."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"hidden-state payload must be a mapping, got {type(obj).__name__}")
    missing = {"dtype", "shape", "data", "positions"} - set(obj)
    if missing:
        raise ValueError(f"hidden-state payload lacks {sorted(missing)}")
    name = obj["dtype"]
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(SUPPORTED_DTYPES)}")
    shape = obj["shape"]
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) != 2
        or not all(_is_int(s) and s >= 0 for s in shape)
    ):
        raise ValueError(f"shape must be [n, H] with non-negative integers, got {shape!r}")
    n, hidden = int(shape[0]), int(shape[1])
    positions = obj["positions"]
    if not isinstance(positions, (list, tuple)):
        raise ValueError(f"positions must be a list, got {type(positions).__name__}")
    pos = _check_positions(positions, n)
    data = obj["data"]
    if not isinstance(data, (str, bytes)):
        raise ValueError(f"data must be a base64 string, got {type(data).__name__}")
    try:
        raw = _b64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"data is not valid base64: {exc}") from exc
    wire = np.dtype(SUPPORTED_DTYPES[name][1])
    expected = n * hidden * wire.itemsize
    if len(raw) != expected:
        raise ValueError(
            f"data holds {len(raw)} bytes but shape {[n, hidden]} of {name} needs {expected}"
        )
    flat = np.frombuffer(raw, dtype=wire).astype(wire.newbyteorder("="), copy=True)
    return flat.reshape(n, hidden), name, pos


def decode_rows(obj: Mapping[str, Any]) -> tuple[torch.Tensor, list[int]]:
    """Inverse of :func:`encode_rows`: a CPU tensor of the original dtype and the positions."""
    bits, name, pos = _decode_bits(obj)
    torch_dtype = SUPPORTED_DTYPES[name][0]
    return torch.from_numpy(bits).view(torch_dtype), pos


def decode_rows_numpy(obj: Mapping[str, Any]) -> tuple[np.ndarray, list[int]]:
    """Decode without torch. bfloat16 comes back as exact float32 (its bits are the top
    half of a float32), float16 and float32 keep their dtype."""
    bits, name, pos = _decode_bits(obj)
    if name == "bfloat16":
        widened = bits.view(np.uint16).astype(np.uint32) << np.uint32(16)
        return widened.view(np.float32), pos
    return bits, pos


def rows_to_list(rows: torch.Tensor) -> list[list[float]]:
    """Upstream-compatible nested float lists (exact values; slow and large, see encode_rows)."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError(f"rows must be a 2-D tensor [n, H], got {getattr(rows, 'shape', rows)!r}")
    return rows.detach().to("cpu").tolist()
