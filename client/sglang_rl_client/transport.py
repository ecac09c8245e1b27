"""JSON over HTTP to an sglang server, with retries, backoff, a timeout and an API key.

Standard library only (urllib). A request is retried when the server cannot be reached, the
connection breaks or times out, or the server answers 5xx; a 4xx answer is the caller's problem
and is raised at once. Every failure is a ``ServerError`` whose message is one line.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Optional

MAX_DETAIL = 300


class ServerError(Exception):
    """A request that got no usable answer: ``status`` is the HTTP status (None when the server
    did not answer) and ``retryable`` says whether trying again could help."""

    def __init__(self, message: str, status: Optional[int] = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


def one_line(text: object, limit: int = MAX_DETAIL) -> str:
    """The text on one line (whitespace runs collapsed), cut to ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


@dataclass
class Transport:
    """Where requests go and how they are retried.

    ``retries`` extra attempts follow a retryable failure, the k-th after ``backoff * 2**k``
    seconds (at most ``max_backoff``); ``timeout`` bounds each attempt. ``api_key`` is sent as
    ``Authorization: Bearer KEY``, which sglang's ``--api-key`` checks.
    """

    url: str
    api_key: Optional[str] = None
    timeout: float = 600.0
    retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 30.0
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"the server URL must start with http:// or https://, got {self.url!r}")
        if self.retries < 0 or self.timeout <= 0 or self.backoff < 0:
            raise ValueError("retries and backoff must not be negative, timeout must be positive")

    def headers(self) -> dict[str, str]:
        """The headers of every request (JSON, and the API key when there is one)."""
        out = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out

    def post(self, path: str, body: Any) -> Any:
        """POST ``body`` as JSON to ``path``; the decoded answer, after retries."""
        return self._with_retries(lambda: self._once("POST", path, json.dumps(body).encode()))

    def get(self, path: str) -> Any:
        """GET ``path``; the decoded JSON answer, after retries."""
        return self._with_retries(lambda: self._once("GET", path, None))

    def _with_retries(self, attempt: Callable[[], Any]) -> Any:
        for tried in range(self.retries + 1):
            try:
                return attempt()
            except ServerError as exc:
                if not exc.retryable or tried == self.retries:
                    if tried and exc.retryable:
                        raise ServerError(f"{exc} (after {tried + 1} attempts)", exc.status, True) from None
                    raise
            self.sleep(min(self.max_backoff, self.backoff * 2**tried))
        raise AssertionError("unreachable")

    def _once(self, method: str, path: str, data: Optional[bytes]) -> Any:
        url = self.url + path
        request = urllib.request.Request(url, data=data, headers=self.headers(), method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = one_line(exc.read().decode(errors="replace")) if exc.fp is not None else ""
            raise ServerError(f"HTTP {exc.code} from {url}: {detail or exc.reason}", exc.code,
                              retryable=exc.code >= 500) from None
        except urllib.error.URLError as exc:
            raise ServerError(f"cannot reach {url}: {one_line(exc.reason)}", retryable=True) from None
        except (socket.timeout, TimeoutError):
            raise ServerError(f"no answer from {url} within {self.timeout:g} s", retryable=True) from None
        except (http.client.HTTPException, ConnectionError, OSError) as exc:
            # the connection broke mid-answer (reset, closed, truncated)
            raise ServerError(f"connection to {url} failed: {one_line(exc) or type(exc).__name__}",
                              retryable=True) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"the answer from {url} is not JSON: {one_line(raw[:200])}") from None
