"""Smoke test: benchmarks/method_cost.py runs every method on a tiny config and prints its ratios.

Not a timed test: no threshold on any time. What is checked is that every method's step ran, that
the printed ratios are the quotients of the reported medians and memories, and that the JSON is
written.
"""

import json
import re

import pytest

from benchmarks import method_cost
from tests.helpers.bench_smoke import TINY, fast_xla  # noqa: F401 (autouse)


def test_method_cost_runs_every_method_and_prints_ratios(tmp_path, capsys):
  out = tmp_path / "cost.json"
  res = method_cost.main(
      TINY + ["--rounds", "2", "--warmup", "1", "--pause", "0", "--out", str(out)]
  )
  printed = capsys.readouterr().out
  rows = res["methods"]
  assert list(rows) == list(method_cost.METHODS)
  lora = rows["lora"]
  for name, row in rows.items():
    assert len(row["times_ms"]) == 2 and all(t > 0 for t in row["times_ms"]), name
    assert row["xla"]["peak_bytes"] > 0 and row["compile_s"] > 0, name
    assert row["time_ratio_over_lora"] == pytest.approx(row["median_ms"] / lora["median_ms"])
    if name == "lora":
      continue
    match = re.search(rf"ratio step time {re.escape(name)} / lora: ([0-9.]+)", printed)
    assert match and float(match.group(1)) == pytest.approx(row["time_ratio_over_lora"], abs=1e-4)
    match = re.search(rf"XLA memory {re.escape(name)} / lora: ([0-9.]+)", printed)
    ratio = row["xla"]["peak_bytes"] / lora["xla"]["peak_bytes"]
    assert match and float(match.group(1)) == pytest.approx(ratio, abs=1e-4)
  # LoRA-Pro keeps Adam moments of every d_in x d_out equivalent gradient: more state than AdamW
  assert rows["lorapro"]["opt_state_bytes"] > 2 * lora["opt_state_bytes"]
  assert rows["loradash"]["dash_launch_s"] > 0
  assert rows["adalora"]["lora_params"] > lora["lora_params"]  # the lora_e vectors
  assert json.loads(out.read_text())["config"]["rank"] == 4


def test_method_cost_rejects_bad_methods():
  with pytest.raises(ValueError, match="--methods"):
    method_cost.main(TINY + ["--methods", "adalora,lora"])
  with pytest.raises(ValueError, match="--methods"):
    method_cost.main(TINY + ["--methods", "lora,qlora"])
