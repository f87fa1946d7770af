"""Smoke test: benchmarks/memory.py measures each side in its own process and prints its table.

Not a timed test: no threshold on any time or memory. What is checked is that the sides ran in
their own processes with the batch asked for, that the printed ratio is the quotient of the
reported peaks, and that bad arguments are one clear error.
"""

import json
import re

import pytest

from benchmarks import memory
from tests.helpers.bench_smoke import fast_xla  # noqa: F401 (autouse)

TINY = ["--tiny", "--seq", "16", "--batch", "2", "--steps", "2"]


def test_memory_benchmark_runs_its_sides_and_prints_ratios(tmp_path, capsys):
  out = tmp_path / "memory.json"
  args = ["--sides", "anlr,peft", "--side_batch", "peft=1", "--time_rounds", "0", "--out", str(out)]
  res = memory.main(TINY + args)
  printed = capsys.readouterr().out
  sides = res["sides"]
  assert set(sides) == {"anlr", "peft"}
  assert sides["anlr"]["batch"] == 2 and sides["peft"]["batch"] == 1
  assert all(s["peak_rss_mib"] > 100 and len(s["step_s"]) == 1 for s in sides.values())
  assert sides["anlr"]["xla"]["temp_size_in_bytes"] > 0
  row = re.search(r"^anlr +2 x 16 +([0-9.]+) +1\.00 ", printed, re.M)
  assert row and float(row.group(1)) == pytest.approx(
      sides["anlr"]["peak_rss_mib"] / 1024, abs=6e-3
  )
  assert re.search(r"^peft +1 x 16 +[0-9.]+ +- ", printed, re.M)  # another batch: no ratio
  assert res["timing"] is None
  assert json.loads(out.read_text())["config"]["seq"] == 16


def test_the_scorer_side_runs_in_process():
  cfg = memory._config(memory.parse_args(TINY), 2)
  res = memory.worker("scorer", cfg, 1024, "full", 2)
  assert res["side"] == "scorer" and res["peak_rss_mib"] > 0 and len(res["step_s"]) == 1


@pytest.mark.parametrize(
    "args, match",
    [
        (["--sides", "anlr,gpu"], "--sides"),
        (["--side_batch", "peft=0"], "--side_batch"),
        (["--remat", "some"], "--remat"),
        (["--time_sides", "anlr"], "--time_sides"),
    ],
)
def test_bad_arguments_are_named(args, match):
  with pytest.raises(ValueError, match=match):
    memory.main(TINY + args)
