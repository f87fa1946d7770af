"""An HTTP client of an OpenAI-compatible chat endpoint, for the MT-Bench judge (``eval.judge.url``).

:class:`ChatClient` sends ``GET <base>/models`` and ``POST <base>/chat/completions`` with the
standard library's ``urllib``. A call that meets a passing fault -- HTTP 429, 500, 502, 503 or 504,
no answer within ``timeout`` seconds, a refused or dropped connection -- is tried again, up to
``max_retries`` times, after waiting

    wait_n = Retry-After                                 when the answer gives one (capped)
           = min(RETRY_CAP_S, RETRY_BASE_S * 2**n) * u,  u ~ Uniform(0.5, 1)   otherwise

(exponential backoff with jitter, so parallel requests do not come back in step). Any other HTTP
error (400, 401, 404, ...) is not retried. When the retries are spent the call raises
:class:`EndpointError`, one line naming the URL, the cause and the number of attempts.

The API key (read from an environment variable by the caller) is sent only as the
``Authorization: Bearer`` header: every error line and every reply text handed back has it
replaced by ``***`` (a server may echo it), and URLs are shown without user info or query.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses retried: rate limits and passing server faults."""

RETRY_BASE_S = 1.0
"""The first wait before a retry without ``Retry-After`` (seconds); doubled at each retry."""

RETRY_CAP_S = 60.0
"""The longest wait between two tries (seconds), ``Retry-After`` included."""


class EndpointError(ValueError):
  """The judge's endpoint refused, timed out or answered something else than a chat completion."""


class _Passing(Exception):
  """A fault worth another try: the one-line reason and the server's ``Retry-After``, if any."""

  def __init__(self, reason: str, retry_after: float | None = None):
    super().__init__(reason)
    self.retry_after = retry_after


def api_urls(url: str) -> tuple[str, str]:
  """``(chat completions URL, models URL)`` of ``eval.judge.url``: the API's base
  (``http://host:port/v1``) or its ``.../chat/completions`` route."""
  base = url.rstrip("/")
  if base.endswith("/chat/completions"):
    base = base[: -len("/chat/completions")]
  return f"{base}/chat/completions", f"{base}/models"


def shown_url(url: str) -> str:
  """``url`` as it may be printed: without user info (``user:key@``), query or fragment."""
  parts = urllib.parse.urlsplit(url)
  host = parts.hostname or ""
  if parts.port:
    host = f"{host}:{parts.port}"
  return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def retry_after(value: str | None) -> float | None:
  """Seconds of a ``Retry-After`` header (delta-seconds or an HTTP date); None when absent or
  unreadable."""
  if not value:
    return None
  value = value.strip()
  with contextlib.suppress(ValueError):
    return max(0.0, float(value))
  with contextlib.suppress(TypeError, ValueError, IndexError):
    return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
  return None


class ChatClient:
  """The endpoint ``url`` (``eval.judge.url``) with retries (see the module doc).

  Args:
    url: the API's base URL or its ``/chat/completions`` route.
    key: the API key, or None.
    timeout: seconds to wait for each answer.
    max_retries: tries after the first one for a passing fault.
    log: where a retry is reported (one line each); None: silent.
  """

  def __init__(
      self,
      url: str,
      *,
      key: str | None = None,
      timeout: float = 600.0,
      max_retries: int = 16,
      log=None,
  ):
    self.chat_url, self.models_url = api_urls(url)
    self.key = key or None
    self.timeout = timeout
    self.max_retries = max_retries
    self.log = log
    self.calls = 0
    """HTTP requests sent so far, retries included."""

  def redact(self, text: str) -> str:
    """``text`` with the API key replaced by ``***``."""
    return text.replace(self.key, "***") if self.key else text

  def models(self) -> Any:
    """The decoded ``GET <base>/models``."""
    return self.call(self.models_url, None)

  def chat(self, body: dict[str, Any]) -> str:
    """``choices[0].message.content`` of ``POST <base>/chat/completions`` with ``body``."""
    reply = self.call(self.chat_url, body)
    try:
      content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
      content = None
    if not isinstance(content, str):
      raise EndpointError(
          f"eval.judge.url: {shown_url(self.chat_url)}: the reply has no"
          " choices[0].message.content"
      )
    return self.redact(content)

  def call(self, url: str, body: dict[str, Any] | None) -> Any:
    """The decoded JSON reply of a GET (``body`` None) or POST to ``url``, retried on passing
    faults; :class:`EndpointError` (one line) when it fails for good."""
    for attempt in range(self.max_retries + 1):
      try:
        return self._once(url, body)
      except _Passing as fault:
        if attempt == self.max_retries:
          tries = f"{attempt + 1} tries" if attempt else "1 try"
          raise EndpointError(
              f"{fault} (gave up after {tries}, eval.judge.max_retries={self.max_retries})"
          ) from None
        wait = fault.retry_after
        if wait is None:
          wait = min(RETRY_CAP_S, RETRY_BASE_S * 2**attempt) * random.uniform(0.5, 1.0)
        wait = min(wait, RETRY_CAP_S)
        if self.log is not None:
          self.log(f"  {fault}; retrying in {wait:.1f}s ({attempt + 1}/{self.max_retries})")
        time.sleep(wait)
    raise AssertionError("unreachable")

  def _once(self, url: str, body: dict[str, Any] | None) -> Any:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if self.key:
      headers["Authorization"] = f"Bearer {self.key}"
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(url, data=data, headers=headers)
    where = f"eval.judge.url: {shown_url(url)}"
    self.calls += 1
    try:
      with urllib.request.urlopen(request, timeout=self.timeout) as reply:
        payload = reply.read()
    except urllib.error.HTTPError as err:
      detail = err.read().decode("utf-8", "replace")
      with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        detail = json.loads(detail)["error"]["message"]
      detail = self.redact(" ".join(str(detail).split())[:300])
      message = f"{where} answered HTTP {err.code} {err.reason}: {detail}"
      if err.code in RETRY_STATUSES:
        raise _Passing(message, retry_after(err.headers.get("Retry-After"))) from None
      raise EndpointError(message) from None
    except urllib.error.URLError as err:
      if isinstance(err.reason, TimeoutError):
        raise _Passing(f"{where} did not answer within {self.timeout:g}s (eval.judge.timeout)")
      reason = getattr(err.reason, "strerror", None) or err.reason
      raise _Passing(f"{where} is unreachable: {reason}") from None
    except TimeoutError:
      raise _Passing(
          f"{where} did not answer within {self.timeout:g}s (eval.judge.timeout)"
      ) from None
    except (ConnectionError, http.client.HTTPException) as err:
      raise _Passing(f"{where} broke the connection: {err or type(err).__name__}") from None
    try:
      return json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
      raise EndpointError(f"{where} answered something that is not JSON") from None


__all__ = [
    "RETRY_STATUSES",
    "ChatClient",
    "EndpointError",
    "api_urls",
    "retry_after",
    "shown_url",
]
