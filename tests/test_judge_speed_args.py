"""benchmarks/judge_speed.py: a setting is dtype:quantize with an optional batch of its own."""

import pytest

from benchmarks import judge_speed


def test_a_setting_may_carry_its_own_batch():
  assert judge_speed.parse_setting("float32:none", 4) == ("float32", "none", 4)
  assert judge_speed.parse_setting("float32:nf4:8", 1) == ("float32", "nf4", 8)
  for bad in ("float32", "float32:nf4:eight", "a:b:1:2"):
    with pytest.raises(ValueError, match="--settings"):
      judge_speed.parse_setting(bad, 1)
