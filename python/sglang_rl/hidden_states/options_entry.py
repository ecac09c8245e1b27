"""A request's hidden-state options as JSON scalars, the form in which they ride in sglang's
`custom_params` from the API process (`options_to_entry`) to the scheduler (`options_from_entry`)."""

from __future__ import annotations

from typing import Optional

from sglang_rl.hidden_states.packing import (
    HiddenStatesFormat,
    HiddenStatesMode,
    HiddenStatesOptions,
    HiddenStatesScope,
)


def options_to_entry(opts: HiddenStatesOptions) -> dict:
    """Flatten validated options into JSON scalars for custom_params."""
    return {
        "hs_mode": opts.mode.value,
        "hs_format": opts.format.value,
        "hs_scope": opts.scope.value,
        "hs_last_n": opts.last_n,
        "hs_final": opts.final_row,
    }


def options_from_entry(entry: dict) -> Optional[HiddenStatesOptions]:
    """The options of a request's custom_params entry (None: it asked for no hidden states)."""
    if "hs_mode" not in entry:
        return None
    return HiddenStatesOptions(
        mode=HiddenStatesMode(entry["hs_mode"]),
        format=HiddenStatesFormat(entry["hs_format"]),
        scope=HiddenStatesScope(entry["hs_scope"]),
        last_n=entry.get("hs_last_n"),
        final_row=bool(entry.get("hs_final")),
    )
