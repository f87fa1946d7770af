"""``anlr serve``: a model (base or base + adapter) behind an OpenAI-compatible chat endpoint.

Two routes, the subset of the OpenAI API that chat clients and LLM judges use:

- ``GET /v1/models``: ``{"object": "list", "data": [{"id": <name>, "object": "model", ...}]}``;
- ``POST /v1/chat/completions`` with ``{"messages": [{"role", "content"}, ...], "max_tokens",
  "temperature", "seed", "stop", "stream", "stream_options", "model"}``: the messages in the
  model's prompt template (``data.template``, the run's own for a run directory; ``chat``: the
  tokenizer's chat template), tokenised as ``anlr eval`` tokenises prompts, decoded greedily at
  temperature 0, else sampled with ``seed``, up to ``max_tokens`` new tokens, the template's
  end-of-turn token or a ``stop`` string (cut from the reply). The reply is a ``chat.completion``
  object: ``choices[0].message.content`` (the new tokens decoded without special tokens, not
  stripped), ``finish_reason`` (``stop`` or ``length``) and ``usage``. With ``stream: true`` it
  is a stream of server-sent events: ``chat.completion.chunk`` objects (the role, then the text as
  it is decoded, then the finish reason; the usage last when ``stream_options.include_usage``),
  then ``data: [DONE]``.

Requests are decoded together, up to ``max_batch`` at once, by the continuous batching of
:mod:`anlr_jax.app.batch_engine`: each reply is the one the request gets alone. The template's
shared start (:meth:`ChatService.shared_prefix`, e.g. a chat template's default system prompt) is
run through the model once; each prompt that starts with it is prefilled from there on. Up to
``max_queue`` more wait; beyond that a request is answered HTTP 429 with ``Retry-After``. A client
that leaves a stream frees its place at the next token.

The HTTP side is the standard library's :class:`http.server.ThreadingHTTPServer`: one thread per
connection, so a slow or idle client holds only its own thread; a connection silent for
``idle_timeout`` seconds, or a body not all there within ``body_timeout`` seconds (HTTP 408), is
closed; a body over :data:`MAX_BODY` is refused (413) unread. A bad request is answered with HTTP
400 (404 for an unknown model or route) and an OpenAI-style body ``{"error": {"message", "type",
"param"}}``, one line saying what is wrong (:mod:`anlr_jax.app.chat_request`). Other request
fields (``top_p``, ...) are ignored.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from anlr_jax import rundir
from anlr_jax.app.chat_request import (
    ChatRequest,
    RequestError,
    message_list,
    number,
    stop_strings,
)
from anlr_jax.app.batch_engine import BatchEngine, Generation, QueueFull
from anlr_jax.app.config import RunConfig, load_config
from anlr_jax.app.model import is_run_dir, load_adapted_model
from anlr_jax.app.report import Log, say
from anlr_jax.data import end_of_turn_id
from anlr_jax.data.chat import require_chat_template
from anlr_jax.evals.mtbench import conversation_prompt

MAX_BODY = 16 << 20
"""Largest request body read (bytes); a longer one is refused (HTTP 413)."""

MAX_CHARS_PER_TOKEN = 64
"""Messages longer than this many characters per context token are refused without tokenising
them (no tokenizer's tokens are that long; tokenising megabytes would hold the process up)."""

RETRY_AFTER_S = 1
"""The ``Retry-After`` (seconds) of a request refused because the queue is full (HTTP 429)."""


class _Text:
  """The reply's text as its tokens arrive: cut at the first stop string, and the part that is
  safe to send (nothing that a later token could turn into a stop string or complete as a
  character)."""

  def __init__(self, service: ChatService, stops: Sequence[str]):
    self.service, self.stops = service, stops
    self.ids: list[int] = []
    self.text = ""
    self.sent = ""
    self.stopped = False

  def add(self, token: int) -> str:
    """Takes one new token; returns the text to send now (may be empty)."""
    self.ids.append(token)
    with self.service._tokenizer_lock:
      text = self.service.tokenizer.decode(self.ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in self.stops if s in text]
    if cuts:
      text, self.stopped = text[: min(cuts)], True
    self.text = text
    if not self.stopped:
      text = text[: len(text) - max((len(s) - 1 for s in self.stops), default=0)]
      text = text.rstrip("\ufffd")  # a character whose bytes are not all there yet
    return self._delta(text)

  def rest(self) -> str:
    """The text not sent yet, once the reply has ended."""
    return self._delta(self.text)

  def _delta(self, text: str) -> str:
    if not text.startswith(self.sent):  # decoding changed what was sent: wait for the end
      return ""
    delta, self.sent = text[len(self.sent) :], text
    return delta


@dataclasses.dataclass
class ChatService:
  """A loaded model answering chat completion requests, concurrent ones decoded in one batch
  (:class:`~anlr_jax.app.batch_engine.BatchEngine`).

  Attributes:
    name: the model id of ``/v1/models`` (requests naming another model are refused).
    model: the model (eval mode).
    tokenizer: its tokenizer.
    template: ``chat`` (the tokenizer's chat template) or ``alpaca`` (the multi-turn Alpaca layout
      of training; a system message goes before the first instruction).
    max_tokens: new tokens of a request that gives no ``max_tokens`` (fewer when the context
      ends first).
    context: the model's context length (prompt plus new tokens).
    max_batch: requests decoded together at most.
    max_queue: requests waiting for a place in the batch at most; more get HTTP 429.
  """

  name: str
  model: Any
  tokenizer: Any
  template: str = "chat"
  max_tokens: int = 1024
  context: int | None = None
  max_batch: int = 8
  max_queue: int = 64
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))
  completions: int = 0
  """Requests answered so far (the sampling seed of a request that gives none)."""
  engine: BatchEngine = dataclasses.field(init=False, repr=False)
  _tokenizer_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def __post_init__(self):
    tok = self.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    self.pad_id = int(pad or 0)
    self.stop_id = end_of_turn_id(tok) if self.template == "chat" else tok.eos_token_id
    self.engine = BatchEngine(
        self.model,
        pad_id=self.pad_id,
        max_batch=self.max_batch,
        max_queue=self.max_queue,
        prefix=self.shared_prefix(),
    )

  def shared_prefix(self) -> list[int]:
    """The token ids that every prompt of a conversation without a system message starts with
    in :attr:`template` (a chat template's default system prompt and the opening of the user's
    turn): the common start of a few probe prompts, less its last token (which a message's first
    characters might merge with). The batch engine computes their keys and values once and
    reuses them for every prompt that starts with them. Empty when the probes share nothing."""
    try:
      probes = [self.prompt_ids([("user", text)]) for text in ("Hello.", "2 + 2 = ?", "Why")]
    except Exception:  # noqa: BLE001  (a template that rejects the probes: no shared prefix)
      return []
    n = 0
    while all(n < len(p) and p[n] == probes[0][n] for p in probes):
      n += 1
    return probes[0][: max(n - 1, 0)]

  def close(self) -> None:
    """Stops the batch engine's thread."""
    self.engine.close()

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
    with self._tokenizer_lock:
      return bos + tok(self.prompt(messages), add_special_tokens=False).input_ids

  def parse(self, body: Any) -> ChatRequest:
    """The checked request of ``body`` (a decoded JSON value); :class:`RequestError` for a bad
    request (see the module doc)."""
    if not isinstance(body, Mapping):
      raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model not in (None, "", self.name):
      raise RequestError(
          f"model {model!r} is not served here; this server serves {self.name!r}",
          param="model",
          status=404,
      )
    if number(body, "n", 1, integer=True, low=1) != 1:
      raise RequestError("'n' must be 1: one reply per request", param="n")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
      raise RequestError("'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
      raise RequestError("'stream_options' must be an object", param="stream_options")
    messages = message_list(body.get("messages"))
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = number({"max_tokens": limit}, "max_tokens", None, integer=True, low=1)
    temperature = number(body, "temperature", 1.0, integer=False, low=0, high=2)
    seed = number(body, "seed", None, integer=True, low=0)
    stop = stop_strings(body.get("stop"))
    chars = sum(len(c) for _, c in messages)
    if self.context is not None and chars > MAX_CHARS_PER_TOKEN * self.context:
      raise RequestError(  # refused before tokenising it: no tokenizer takes that long a text
          f"the messages ({chars} characters) are longer than the model's context of"
          f" {self.context} tokens",
          param="messages",
      )
    try:
      ids = self.prompt_ids(messages)
    except RequestError:
      raise
    except Exception as err:  # noqa: BLE001  (the template rejects these messages)
      raise RequestError(f"the model's template rejects these messages: {err}", param="messages")
    if self.context is not None:
      room = self.context - len(ids)
      if max_tokens is None and room >= 1:
        max_tokens = min(self.max_tokens, room)
      if max_tokens is None or max_tokens > room:
        asked = f" plus max_tokens ({max_tokens})" if max_tokens is not None else ""
        raise RequestError(
            f"the prompt ({len(ids)} tokens){asked} exceed the model's context of"
            f" {self.context} tokens",
            param="max_tokens" if max_tokens is not None else "messages",
        )
    return ChatRequest(
        ids=ids,
        max_tokens=max_tokens or self.max_tokens,
        temperature=float(temperature),
        seed=seed,
        stop=stop,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
    )

  def start(self, request: ChatRequest) -> Generation:
    """Queues ``request`` for decoding; :class:`RequestError` 429 when the queue is full."""
    seed = self.completions if request.seed is None else request.seed
    self.completions += 1
    generation = Generation(
        request.ids,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        seed=seed % (1 << 32),
        stop_id=self.stop_id,
    )
    try:
      return self.engine.submit(generation)
    except QueueFull as err:
      raise RequestError(f"the server is busy ({err}); retry later", status=429) from None

  def pieces(
      self, request: ChatRequest, generation: Generation
  ) -> Iterator[tuple[str, str | None, int]]:
    """``(text, finish reason or None, new tokens so far)`` as the reply is decoded; the last
    has the finish reason (``stop`` or ``length``). :class:`RuntimeError` when decoding failed."""
    text = _Text(self, request.stop)
    made, pending = 0, ""
    for token in generation.tokens():
      made += 1
      delta = text.add(token)
      if text.stopped:  # the stop string and what follows it are not sent
        generation.cancel()
        pending = delta
        break
      if delta:
        yield delta, None, made
    if generation.finish and generation.finish.startswith("error"):
      raise RuntimeError(f"decoding failed: {generation.finish[len('error: '):]}")
    finish = "stop" if text.stopped or generation.finish == "stop" else "length"
    yield pending + text.rest(), finish, made

  def _envelope(self, kind: str, ident: str) -> dict[str, Any]:
    return {"id": ident, "object": kind, "created": int(time.time()), "model": self.name}

  def complete(self, body: Any) -> dict[str, Any]:
    """The ``chat.completion`` object answering the request ``body`` (not streamed; see
    :meth:`chunks` for ``stream: true``)."""
    return self.answer(self.parse(body))

  def answer(self, request: ChatRequest) -> dict[str, Any]:
    """The ``chat.completion`` object of a checked request (decoded whole)."""
    generation = self.start(request)
    try:
      parts = list(self.pieces(request, generation))
    finally:
      generation.cancel()
    made, finish = parts[-1][2], parts[-1][1]
    reply = self._envelope("chat.completion", f"chatcmpl-{uuid.uuid4().hex}")
    message = {"role": "assistant", "content": "".join(p[0] for p in parts)}
    reply["choices"] = [{"index": 0, "message": message, "finish_reason": finish}]
    reply["usage"] = _usage(len(request.ids), made)
    return reply

  def chunks(self, request: ChatRequest, generation: Generation) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a streamed reply: the role, the text as it is
    decoded, the finish reason, and the usage when ``stream_options.include_usage`` asks."""
    envelope = self._envelope("chat.completion.chunk", f"chatcmpl-{uuid.uuid4().hex}")
    choice = lambda delta, finish=None: {"index": 0, "delta": delta, "finish_reason": finish}
    usage = {"usage": None} if request.include_usage else {}
    yield envelope | {"choices": [choice({"role": "assistant", "content": ""})]} | usage
    made = 0
    for text, finish, made in self.pieces(request, generation):
      if text:
        yield envelope | {"choices": [choice({"content": text})]} | usage
      if finish:
        yield envelope | {"choices": [choice({}, finish)]} | usage
    if request.include_usage:
      yield envelope | {"choices": [], "usage": _usage(len(request.ids), made)}

  def models(self) -> dict[str, Any]:
    """The ``/v1/models`` list: this server's one model."""
    return {
        "object": "list",
        "data": [{"id": self.name, "object": "model", "created": self.created, "owned_by": "anlr"}],
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
  return {
      "prompt_tokens": prompt,
      "completion_tokens": completion,
      "total_tokens": prompt + completion,
  }


def _error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
  kind = "invalid_request_error" if status < 500 else "server_error"
  return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class _Handler(BaseHTTPRequestHandler):
  """The routes of :class:`ChatService` (``server.service``)."""

  protocol_version = "HTTP/1.1"
  server_version = "anlr-serve"

  def setup(self):
    self.timeout = self.server.idle_timeout  # a connection idle this long is closed
    super().setup()

  def _send(self, status: int, value: Mapping[str, Any], headers: Mapping[str, str] = {}) -> None:
    data = json.dumps(value, ensure_ascii=False).encode("utf-8")
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    for key, value in headers.items():
      self.send_header(key, value)
    if self.close_connection:
      self.send_header("Connection", "close")
    self.end_headers()
    self.wfile.write(data)

  def _fail(self, status: int, message: str, param: str | None = None) -> None:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else {}
    self._send(status, _error_body(message, status, param), headers)

  def _route(self) -> str:
    return self.path.split("?", 1)[0].rstrip("/")

  def do_GET(self):  # noqa: N802  (http.server's name)
    if self._route() in ("/v1/models", "/models"):
      self._send(HTTPStatus.OK, self.server.service.models())
    else:
      self._fail(404, f"no route GET {self.path}; try GET /v1/models")

  def _read_body(self, length: int) -> bytes | None:
    """The body, read within ``server.body_timeout`` seconds in all (a client sending it slowly
    is answered 408 and dropped); None when the client went away."""
    deadline = time.monotonic() + self.server.body_timeout
    parts, left = [], length
    try:
      while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise TimeoutError
        self.connection.settimeout(remaining)
        part = self.rfile.read1(min(left, 1 << 16))
        if not part:
          return None
        parts.append(part)
        left -= len(part)
    except TimeoutError:
      self.close_connection = True
      self._fail(408, f"the request body did not arrive within {self.server.body_timeout:g}s")
      return None
    except OSError:
      self.close_connection = True
      return None
    self.connection.settimeout(self.timeout)
    return b"".join(parts)

  def do_POST(self):  # noqa: N802
    try:
      length = int(self.headers.get("Content-Length") or 0)
    except ValueError:
      length = -1
    if length < 0:
      self.close_connection = True
      self._fail(400, "the request needs a valid Content-Length header")
      return
    if length > MAX_BODY:
      self.close_connection = True
      self._fail(413, f"the request body exceeds {MAX_BODY} bytes")
      return
    raw = self._read_body(length) if length else b""
    if raw is None:
      self.close_connection = True
      return
    if self._route() not in ("/v1/chat/completions", "/chat/completions"):
      self._fail(404, f"no route POST {self.path}; try /v1/chat/completions")
      return
    service = self.server.service
    try:
      try:
        body = json.loads(raw.decode("utf-8"))
      except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RequestError(f"the request body is not JSON: {err}") from None
      except RecursionError:
        raise RequestError("the request body is not JSON this server reads: nested too deeply")
      request = service.parse(body)
      if not request.stream:
        self._send(HTTPStatus.OK, service.answer(request))
        return
      generation = service.start(request)
    except RequestError as err:
      self._fail(err.status, str(err), err.param)
      return
    except Exception as err:  # noqa: BLE001  (the server stays up; the client gets the reason)
      self._fail(500, " ".join(f"{type(err).__name__}: {err}".split()))
      return
    self._stream(service.chunks(request, generation), generation)

  def _stream(self, chunks: Iterator[dict[str, Any]], generation: Generation) -> None:
    """Server-sent events, one ``data:`` line per chunk, then ``data: [DONE]``; a client that
    goes away cancels the generation (its place in the batch is freed)."""
    self.close_connection = True
    try:
      self.send_response(HTTPStatus.OK)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Cache-Control", "no-cache")
      self.send_header("Connection", "close")
      self.end_headers()
      try:
        for chunk in chunks:
          self.wfile.write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")
      except RuntimeError as err:  # decoding failed: the reason as the stream's last event
        self.wfile.write(b"data: " + json.dumps(_error_body(str(err), 500)).encode() + b"\n\n")
      self.wfile.write(b"data: [DONE]\n\n")
    except OSError:  # the client went away
      pass
    finally:
      generation.cancel()

  def log_message(self, format, *args):  # noqa: A002  (http.server's signature)
    if self.server.log_requests:
      super().log_message(format, *args)


class ChatServer(ThreadingHTTPServer):
  """A :class:`ThreadingHTTPServer` of a :class:`ChatService` (``service``): one thread per
  connection (a slow or idle client holds only its own), the model in the service's engine.

  Attributes:
    idle_timeout: seconds a connection may stay silent (between or inside requests' headers).
    body_timeout: seconds a request body may take to arrive, all of it.
  """

  daemon_threads = True
  request_queue_size = 1024  # connections waiting to be accepted (a burst of clients)

  def __init__(
      self,
      address,
      service: ChatService | None,
      *,
      log_requests: bool = True,
      idle_timeout: float = 60.0,
      body_timeout: float = 60.0,
  ):
    super().__init__(address, _Handler)
    self.service = service
    self.log_requests = log_requests
    self.idle_timeout = idle_timeout
    self.body_timeout = body_timeout

  @property
  def url(self) -> str:
    """The base URL of the API, ``http://<host>:<port>/v1``."""
    host, port = self.server_address[:2]
    return f"http://{host}:{port}/v1"


def load_service(
    config: RunConfig,
    adapter: str | None = None,
    *,
    name: str | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    quantize: str | None = None,
) -> ChatService:
  """The :class:`ChatService` of ``model.path`` (+ ``adapter``: a run directory or a PEFT adapter
  directory). A run directory's model is prompted in its own ``data.template``; its base is
  quantised as ``quantize`` says (``--quantize``; None: as ``load_adapted_model`` decides). One-line
  errors name ``model.path`` / ``--adapter``."""
  template = config.data.template
  if adapter is not None and is_run_dir(adapter):
    template = load_config(os.path.join(adapter, rundir.CONFIG_FILE)).data.template
  elif adapter is not None and not os.path.isdir(adapter):
    raise FileNotFoundError(f"--adapter {adapter}: no such directory")
  try:
    model, model_config, tokenizer = load_adapted_model(config, adapter, quantize=quantize)
  except (OSError, ValueError, KeyError, TypeError) as err:
    message = str(err.args[0] if err.args else type(err).__name__)
    if message.startswith(("model.path", "--adapter")):  # already names what is wrong
      raise
    what = f"--adapter {adapter}" if adapter else f"model.path: {config.model.path}"
    raise ValueError(f"{what} does not load: {message}") from None
  if template == "chat":
    require_chat_template(
        tokenizer, f"model.path: {config.model.path}", "serve it with data.template=alpaca"
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
      max_batch=max_batch,
      max_queue=max_queue,
  )


def make_server(
    service: ChatService | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_requests: bool = True,
    idle_timeout: float = 60.0,
    body_timeout: float = 60.0,
) -> ChatServer:
  """A :class:`ChatServer` of ``service`` bound to ``host:port`` (port 0: a free one)."""
  try:
    return ChatServer(
        (host, port),
        service,
        log_requests=log_requests,
        idle_timeout=idle_timeout,
        body_timeout=body_timeout,
    )
  except OSError as err:
    raise ValueError(f"--host {host} --port {port}: cannot listen there: {err.strerror}") from None


def exposure_warning(host: str) -> str | None:
  """The warning for a server listening beyond this machine (``host`` not a loopback address):
  the endpoint has no authentication."""
  try:
    loopback = all(ipaddress.ip_address(a).is_loopback for a in _addresses(host))
  except (OSError, ValueError):
    loopback = False
  if loopback:
    return None
  return (
      f"anlr serve: warning: listening on {host}, beyond this machine, with no authentication:"
      " anyone who can reach this port can use the model (bind to 127.0.0.1, or put the server"
      " behind a proxy that checks an API key)"
  )


def _addresses(host: str) -> list[str]:
  return sorted({info[4][0] for info in socket.getaddrinfo(host or "0.0.0.0", None)})


def start_server(
    config: RunConfig,
    adapter: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    quantize: str | None = None,
    log: Log = say,
) -> ChatServer:
  """The bound server of ``anlr serve`` with its model loaded, not serving yet: the port is taken
  before the model is loaded (a port in use fails at once), and a host beyond this machine gets
  :func:`exposure_warning`."""
  server = make_server(None, host, port)
  warning = exposure_warning(host)
  if warning:
    log(warning)
  try:
    server.service = load_service(
        config, adapter, name=name, max_batch=max_batch, max_queue=max_queue, quantize=quantize
    )
  except BaseException:
    server.server_close()
    raise
  service = server.service
  log(
      f"anlr serve: {service.name} ({service.template} template) at {server.url}"
      f" (POST /chat/completions, GET /models; up to {max_batch} requests decoded together,"
      f" {max_queue} waiting; Ctrl-C stops)"
  )
  return server


def serve_main(config: RunConfig, adapter: str | None = None, **options) -> None:
  """``anlr serve``: loads the model and answers requests until interrupted; ``options`` are
  :func:`start_server`'s."""
  server = start_server(config, adapter, **options)
  try:
    server.serve_forever()
  finally:
    server.server_close()
    server.service.close()


__all__ = [
    "ChatRequest",
    "ChatServer",
    "ChatService",
    "RequestError",
    "exposure_warning",
    "load_service",
    "make_server",
    "serve_main",
    "start_server",
]
