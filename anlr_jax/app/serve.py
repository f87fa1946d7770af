"""``anlr serve``: a model (base or base + adapter) behind an OpenAI-compatible chat endpoint.

Two routes, the subset of the OpenAI API that chat clients and LLM judges use:

- ``GET /v1/models``: ``{"object": "list", "data": [{"id": <name>, "object": "model", ...}]}``;
- ``POST /v1/chat/completions`` with ``{"messages": [{"role", "content"}, ...], "max_tokens",
  "temperature", "seed", "model"}``: the messages in the model's prompt template (``data.template``,
  the run's own for a run directory; ``chat``: the tokenizer's chat template), tokenised as
  ``anlr eval`` tokenises prompts, decoded by :func:`anlr_jax.models.generate` (greedy at
  temperature 0, else sampling seeded by ``seed``), up to ``max_tokens`` new tokens or the template's
  end-of-turn token. The reply is a ``chat.completion`` object: ``choices[0].message.content`` (the
  new tokens decoded without special tokens, not stripped), ``finish_reason`` (``stop`` or
  ``length``) and ``usage`` (prompt, completion and total tokens).

The server is the standard library's :class:`http.server.ThreadingHTTPServer`; requests are taken
concurrently and generated one at a time. A request that is not valid JSON, lacks ``messages``, has
a role other than system / user / assistant, a non-string content, a bad ``max_tokens`` or
``temperature``, asks for ``stream`` or ``n > 1``, or names another model is answered with HTTP 400
(404 for an unknown model or route) and an OpenAI-style body ``{"error": {"message", "type",
"param"}}``, one line saying what is wrong. Other request fields (``top_p``, ``stop``, ...) are
ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jax
import numpy as np

from anlr_jax import rundir
from anlr_jax.app.config import RunConfig, load_config
from anlr_jax.app.text_generation import prompt_width
from anlr_jax.app.model import is_run_dir, load_adapted_model
from anlr_jax.app.report import Log, say
from anlr_jax.data import end_of_turn_id
from anlr_jax.evals.mtbench import conversation_prompt
from anlr_jax.models import generate

ROLES = ("system", "user", "assistant")
"""The message roles a chat completion request may hold."""

MAX_BODY = 16 << 20
"""Largest request body read (bytes); a longer one is refused."""


class RequestError(ValueError):
  """A bad request: HTTP ``status`` and the one-line message of the error body."""

  def __init__(self, message: str, *, param: str | None = None, status: int = 400):
    super().__init__(message)
    self.param = param
    self.status = status


def _message_list(value: Any) -> list[tuple[str, str]]:
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


def _number(body: Mapping[str, Any], key: str, default, *, integer: bool, low: float, high=None):
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
class ChatService:
  """A loaded model answering chat completion requests (:meth:`complete`), one at a time.

  Attributes:
    name: the model id of ``/v1/models`` (requests naming another model are refused).
    model: the model (eval mode).
    tokenizer: its tokenizer.
    template: ``chat`` (the tokenizer's chat template) or ``alpaca`` (the multi-turn Alpaca layout
      of training; a system message goes before the first instruction).
    max_tokens: new tokens of a request that gives no ``max_tokens``.
    context: the model's context length (prompt plus new tokens).
  """

  name: str
  model: Any
  tokenizer: Any
  template: str = "chat"
  max_tokens: int = 1024
  context: int | None = None
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))
  completions: int = 0
  """Requests answered so far (the sampling seed of a request that gives none)."""
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def prompt(self, messages: Sequence[tuple[str, str]]) -> str:
    """The text of ``messages`` up to where the reply starts, in :attr:`template`."""
    if self.template == "chat":
      return self.tokenizer.apply_chat_template(
          [{"role": r, "content": c} for r, c in messages],
          tokenize=False,
          add_generation_prompt=True,
      )
    system = "\n\n".join(c for r, c in messages if r == "system")
    turns = [(r, c) for r, c in messages if r != "system"]
    if not turns or any(r != ("user", "assistant")[i % 2] for i, (r, _) in enumerate(turns)):
      raise RequestError(
          "this model takes the Alpaca layout: user and assistant messages must alternate, user"
          " first",
          param="messages",
      )
    if system:
      turns[0] = ("user", f"{system}\n\n{turns[0][1]}")
    return conversation_prompt(self.tokenizer, turns, "alpaca")

  def prompt_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
    """The prompt's token ids, as ``anlr eval`` tokenises it (bos first for the Alpaca layout)."""
    tok = self.tokenizer
    bos = [] if self.template == "chat" or tok.bos_token_id is None else [tok.bos_token_id]
    return bos + tok(self.prompt(messages), add_special_tokens=False).input_ids

  def generate_ids(self, ids: list[int], *, max_tokens: int, temperature: float, seed: int):
    """``(new token ids up to and including the stop token, finish reason)`` of one prompt:
    greedy at temperature 0, else sampled with ``seed``. The prompt is left-padded to
    :func:`~anlr_jax.app.generation.prompt_width`, as ``anlr eval`` pads a batch."""
    tok = self.tokenizer
    chat = self.template == "chat"
    stop = end_of_turn_id(tok) if chat else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = prompt_width(len(ids))
    row = np.full((1, width), pad, np.int32)
    mask = np.zeros((1, width), np.int32)
    row[0, width - len(ids) :], mask[0, width - len(ids) :] = ids, 1
    sampling = {}
    if temperature > 0:
      sampling = dict(temperature=float(temperature), rng=jax.random.key(seed))
    out = generate(
        self.model,
        row,
        mask,
        max_new_tokens=max_tokens,
        eos_token_id=stop,
        pad_token_id=int(pad),
        **sampling,
    )
    new = np.asarray(out)[0].tolist()
    if stop is not None and stop in new:
      return new[: new.index(stop) + 1], "stop"
    return new, "length"

  def complete(self, body: Any) -> dict[str, Any]:
    """The ``chat.completion`` object answering the request ``body`` (a decoded JSON value);
    :class:`RequestError` for a bad request (see the module doc)."""
    if not isinstance(body, Mapping):
      raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model not in (None, "", self.name):
      raise RequestError(
          f"model {model!r} is not served here; this server serves {self.name!r}",
          param="model",
          status=404,
      )
    if body.get("stream"):
      raise RequestError("'stream' is not supported: ask without it", param="stream")
    if _number(body, "n", 1, integer=True, low=1) != 1:
      raise RequestError("'n' must be 1: one reply per request", param="n")
    messages = _message_list(body.get("messages"))
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": limit}, "max_tokens", self.max_tokens, integer=True, low=1)
    temperature = _number(body, "temperature", 1.0, integer=False, low=0, high=2)
    seed = _number(body, "seed", None, integer=True, low=0)
    with self._lock:  # one generation at a time (the tokenizer is not shared across threads)
      try:
        ids = self.prompt_ids(messages)
      except RequestError:
        raise
      except Exception as err:  # noqa: BLE001  (the template rejects these messages)
        raise RequestError(f"the model's template rejects these messages: {err}", param="messages")
      if self.context is not None and len(ids) + max_tokens > self.context:
        raise RequestError(
            f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceed the model's"
            f" context of {self.context} tokens",
            param="max_tokens",
        )
      new, finish = self.generate_ids(
          ids,
          max_tokens=max_tokens,
          temperature=temperature,
          seed=self.completions if seed is None else seed,
      )
      text = self.tokenizer.decode(new, skip_special_tokens=True)
      self.completions += 1
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": self.name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": len(ids),
            "completion_tokens": len(new),
            "total_tokens": len(ids) + len(new),
        },
    }

  def models(self) -> dict[str, Any]:
    """The ``/v1/models`` list: this server's one model."""
    return {
        "object": "list",
        "data": [{"id": self.name, "object": "model", "created": self.created, "owned_by": "anlr"}],
    }


def _error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
  kind = "invalid_request_error" if status < 500 else "server_error"
  return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class _Handler(BaseHTTPRequestHandler):
  """The routes of :class:`ChatService` (``server.service``)."""

  protocol_version = "HTTP/1.1"
  server_version = "anlr-serve"

  def _send(self, status: int, value: Mapping[str, Any]) -> None:
    data = json.dumps(value, ensure_ascii=False).encode("utf-8")
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _route(self) -> str:
    return self.path.split("?", 1)[0].rstrip("/")

  def do_GET(self):  # noqa: N802  (http.server's name)
    if self._route() in ("/v1/models", "/models"):
      self._send(HTTPStatus.OK, self.server.service.models())
    else:
      self._send(404, _error_body(f"no route GET {self.path}; try GET /v1/models", 404))

  def do_POST(self):  # noqa: N802
    try:
      length = int(self.headers.get("Content-Length") or 0)
    except ValueError:
      length = -1
    if length < 0:
      self.close_connection = True
      self._send(400, _error_body("the request needs a valid Content-Length header", 400))
      return
    if length > MAX_BODY:
      self.close_connection = True
      self._send(413, _error_body(f"the request body exceeds {MAX_BODY} bytes", 413))
      return
    raw = self.rfile.read(length) if length else b""
    if self._route() not in ("/v1/chat/completions", "/chat/completions"):
      self._send(404, _error_body(f"no route POST {self.path}; try /v1/chat/completions", 404))
      return
    try:
      try:
        body = json.loads(raw.decode("utf-8"))
      except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RequestError(f"the request body is not JSON: {err}") from None
      self._send(HTTPStatus.OK, self.server.service.complete(body))
    except RequestError as err:
      self._send(err.status, _error_body(str(err), err.status, err.param))
    except Exception as err:  # noqa: BLE001  (the server stays up; the client gets the reason)
      self._send(500, _error_body(f"{type(err).__name__}: {err}", 500))

  def log_message(self, format, *args):  # noqa: A002  (http.server's signature)
    if self.server.log_requests:
      super().log_message(format, *args)


class ChatServer(ThreadingHTTPServer):
  """A :class:`ThreadingHTTPServer` of a :class:`ChatService` (``service``)."""

  daemon_threads = True

  def __init__(self, address, service: ChatService | None, *, log_requests: bool = True):
    super().__init__(address, _Handler)
    self.service = service
    self.log_requests = log_requests

  @property
  def url(self) -> str:
    """The base URL of the API, ``http://<host>:<port>/v1``."""
    host, port = self.server_address[:2]
    return f"http://{host}:{port}/v1"


def load_service(
    config: RunConfig, adapter: str | None = None, *, name: str | None = None
) -> ChatService:
  """The :class:`ChatService` of ``model.path`` (+ ``adapter``: a run directory or a PEFT adapter
  directory). A run directory's model is prompted in its own ``data.template``. One-line errors
  name ``model.path`` / ``--adapter``."""
  template = config.data.template
  if adapter is not None and is_run_dir(adapter):
    template = load_config(os.path.join(adapter, rundir.CONFIG_FILE)).data.template
  elif adapter is not None and not os.path.isdir(adapter):
    raise FileNotFoundError(f"--adapter {adapter}: no such directory")
  try:
    model, model_config, tokenizer = load_adapted_model(config, adapter)
  except (OSError, ValueError, KeyError, TypeError) as err:
    message = str(err.args[0] if err.args else type(err).__name__)
    if message.startswith(("model.path", "--adapter")):  # already names what is wrong
      raise
    what = f"--adapter {adapter}" if adapter else f"model.path: {config.model.path}"
    raise ValueError(f"{what} does not load: {message}") from None
  if template == "chat" and not getattr(tokenizer, "chat_template", None):
    raise ValueError(
        f"model.path: {config.model.path}: its tokenizer has no chat template; serve it with"
        " data.template=alpaca"
    )
  model.eval()
  if name is None:
    source = adapter or config.model.path
    name = os.path.basename(os.path.normpath(source.split("://", 1)[-1]))
  return ChatService(
      name=name,
      model=model,
      tokenizer=tokenizer,
      template=template,
      max_tokens=config.eval.dialogue_max_new_tokens,
      context=getattr(model_config, "max_position_embeddings", None),
  )


def make_server(
    service: ChatService | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_requests: bool = True,
) -> ChatServer:
  """A :class:`ChatServer` of ``service`` bound to ``host:port`` (port 0: a free one)."""
  try:
    return ChatServer((host, port), service, log_requests=log_requests)
  except OSError as err:
    raise ValueError(f"--host {host} --port {port}: cannot listen there: {err.strerror}") from None


def serve_main(
    config: RunConfig,
    adapter: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str | None = None,
    log: Log = say,
) -> None:
  """``anlr serve``: loads the model and answers requests until interrupted."""
  server = make_server(None, host, port)  # a port in use fails before the model is loaded
  try:
    server.service = service = load_service(config, adapter, name=name)
  except BaseException:
    server.server_close()
    raise
  log(
      f"anlr serve: {service.name} ({service.template} template) at {server.url}"
      " (POST /chat/completions, GET /models; Ctrl-C stops)"
  )
  try:
    server.serve_forever()
  finally:
    server.server_close()


__all__ = [
    "ChatServer",
    "ChatService",
    "RequestError",
    "load_service",
    "make_server",
    "serve_main",
]
