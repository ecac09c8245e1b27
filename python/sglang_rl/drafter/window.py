"""Choose the training window of one sample, giving priority to the end of the response.

Drafter training cost grows with the tokens per sample, so each sample contributes at
most ``window`` (512, as in FastRL and verl-SpeCo) consecutive positions. Like FastRL,
the end of the response is kept first, so the drafter keeps seeing how generations end;
the start of a long response is what gets cut.
"""

from __future__ import annotations

__all__ = ["DEFAULT_WINDOW", "select_window"]

DEFAULT_WINDOW = 512


def select_window(
    seq_len: int,
    response_start: int,
    window: int = DEFAULT_WINDOW,
    response_end: int | None = None,
) -> slice:
    """Slice of ``[0, seq_len)`` to train on.

    The window always ends at ``response_end`` (default ``seq_len``) when it can, so it
    holds as much of the response as fits, counted back from its end; whatever budget the
    response leaves is spent on the context just before it (prompt tokens the drafter
    attends to but takes no loss on). Consequences:

    * response longer than ``window``: the last ``window`` positions, the beginning of
      the response is cut (2048 tokens with 548 response tokens -> ``[1536:2048]``);
    * response that fits: the whole response plus the preceding context;
    * ``seq_len <= window``: the whole sequence.

    ``response_start`` is checked for consistency; with the window anchored at the
    response end it never moves the window.
    """
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be non-negative, got {seq_len}")
    end = seq_len if response_end is None else response_end
    if not 0 <= response_start <= end <= seq_len:
        raise ValueError(
            f"need 0 <= response_start ({response_start}) <= response_end ({end}) "
            f"<= seq_len ({seq_len})"
        )
    span = min(window, seq_len)
    stop = max(end, span)
    return slice(stop - span, stop)
