"""The checks of a chat completion request (``POST /v1/chat/completions``), before it is
tokenised: the messages, the numbers and the stop strings, each refused with one line naming the
field (:class:`RequestError`, an HTTP status and an OpenAI-style ``param``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ROLES = ("system", "user", "assistant")
"""The message roles a chat completion request may hold."""


class RequestError(ValueError):
  """A bad request: HTTP ``status`` and the one-line message of the error body."""

  def __init__(self, message: str, *, param: str | None = None, status: int = 400):
    super().__init__(message)
    self.param = param
    self.status = status


def message_list(value: Any) -> list[tuple[str, str]]:
  """``[(role, content)]`` of the request's ``messages``; the last must not be the assistant's."""
  if not isinstance(value, list) or not value:
    raise RequestError("'messages' must be a non-empty list of {role, content}", param="messages")
  out = []
  for i, message in enumerate(value):
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
      raise RequestError(f"{where} must be an object with 'role' and 'content'", param=where)
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
      raise RequestError(f"{where}.role {role!r} is not one of {list(ROLES)}", param=where)
    if isinstance(content, list):  # OpenAI's content parts: text parts only
      if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        raise RequestError(f"{where}.content: only text parts are served", param=where)
      content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
      raise RequestError(f"{where}.content must be a string", param=where)
    out.append((role, content))
  if out[-1][0] == "assistant":
    raise RequestError("the last message must be the user's (or the system's)", param="messages")
  return out


def number(body: Mapping[str, Any], key: str, default, *, integer: bool, low: float, high=None):
  value = body.get(key, default)
  if value is None:
    return default
  ok = isinstance(value, int) if integer else isinstance(value, (int, float))
  if isinstance(value, bool) or not ok or value < low or (high is not None and value > high):
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    kind = "an integer" if integer else "a number"
    raise RequestError(f"'{key}' must be {kind} {bound}, got {value!r}", param=key)
  return value


@dataclasses.dataclass
class ChatRequest:
  """A checked chat completion request: the prompt's token ids and how to answer it."""

  ids: list[int]
  max_tokens: int
  temperature: float
  seed: int | None
  stop: tuple[str, ...] = ()
  stream: bool = False
  include_usage: bool = False


def stop_strings(value: Any) -> tuple[str, ...]:
  if value is None:
    return ()
  stops = [value] if isinstance(value, str) else value
  if (
      not isinstance(stops, list)
      or len(stops) > 4
      or not all(isinstance(s, str) and s for s in stops)
  ):
    raise RequestError(
        "'stop' must be a non-empty string or a list of up to 4 of them", param="stop"
    )
  return tuple(stops)


__all__ = ["ROLES", "ChatRequest", "RequestError", "message_list", "number", "stop_strings"]
