"""The benchmarks' arguments: judge_speed.py, judge_real.py, judge_longer.py and compile_count.py."""

import pytest

from benchmarks import judge_speed


def test_a_setting_may_carry_its_own_batch():
  assert judge_speed.parse_setting("float32:none", 4) == ("float32", "none", 4)
  assert judge_speed.parse_setting("float32:nf4:8", 1) == ("float32", "nf4", 8)
  for bad in ("float32", "float32:nf4:eight", "a:b:1:2"):
    with pytest.raises(ValueError, match="--settings"):
      judge_speed.parse_setting(bad, 1)


def test_the_real_prompt_benchmark_reads_its_settings_and_the_committed_answers():
  from benchmarks import judge_real

  assert judge_real.parse_setting("int8:256:1") == ("int8", 256, True)
  assert judge_real.parse_setting("none:0:0") == ("none", 0, False)
  for bad in ("int8:256", "int8:x:1", "int8:256:2"):
    with pytest.raises(ValueError, match="--settings"):
      judge_real.parse_setting(bad)
  every = judge_real.real_prompts(judge_real.ANSWERS, 1000)
  assert len(every) == 48  # 24 questions, two turns
  lengths = [len(s) + len(u) for s, u in every]
  assert lengths == sorted(lengths, reverse=True)
  middle = judge_real.real_prompts(judge_real.ANSWERS, 8)
  assert middle == every[20:28] and all("Assistant" in u for _, u in middle)


def test_the_compile_count_benchmark_reads_its_processes_and_sizes():
  import argparse

  from benchmarks import compile_count
  from anlr_jax.models import ModelConfig

  assert compile_count.processes("on,again") == ["on", "again"]
  assert compile_count.processes(" off ") == ["off"]
  for bad, match in (
      ("on,later", "unknown process 'later'"),
      ("again,on", "put 'on' first"),
      ("again", "put 'on' first"),
      (",", "unknown process"),
  ):
    with pytest.raises(argparse.ArgumentTypeError, match=match):
      compile_count.processes(bad)
  ModelConfig(vocab_size=325, **compile_count.TINY)  # a valid model configuration
  smollm2 = ModelConfig.preset("smollm2_135m")  # HuggingFaceTB/SmolLM2-135M: 134.5M weights
  assert "smollm2_135m" in compile_count.SIZES and 134e6 < smollm2.num_params() < 135e6


def test_the_longer_limit_benchmark_takes_the_cut_judgments_only(tmp_path):
  from anlr_jax.evals.mtbench import append_records
  from benchmarks import judge_longer

  loop = "The response is clear and well organised. " * 8
  rows = [
      dict(question_id=1, score=-1, finish_reason="length", judgment="The answer explains the"),
      dict(question_id=2, score=-1, finish_reason="length", judgment=loop),  # a loop: left out
      dict(question_id=3, score=-1, finish_reason="stop", judgment="Assistant A is better."),
      dict(question_id=4, score=7, finish_reason="stop", judgment="Rating: [[7]]"),
  ]
  append_records(tmp_path / "a.jsonl", rows[:2])
  append_records(tmp_path / "b.jsonl", rows[2:])
  picked = judge_longer.cut_records([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
  assert [r["question_id"] for r in picked] == [1]
  loops = judge_longer.cut_records([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], "loop")
  assert [r["question_id"] for r in loops] == [2]
  every = judge_longer.cut_records(
      [f"docs/results/dialogue_epoch/{m}/mt_bench_single.jsonl" for m in ("base", "lora", "anlr")]
  )
  assert len(every) == 28  # docs/results.md section 9: 28 of the 48 unrated were cut
