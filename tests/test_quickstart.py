"""The quickstart (`anlr train` with no arguments): a short variant completes and writes its outputs."""

import csv
import dataclasses
import json
import pathlib

import numpy as np
import pytest

import anlr_jax
from anlr_jax.app import cli, paths
from anlr_jax.assets import QUICKSTART_TASK
from anlr_jax.evals import TASKS
from anlr_jax.app.config import load_config

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_quickstart_is_the_shipped_config_read_from_the_package(capsys):
  shipped = paths.shipped_configs()["quickstart"]
  assert shipped.parent == pathlib.Path(anlr_jax.__file__).parent / "configs"
  assert (REPO / "configs" / "quickstart.yaml").resolve() == shipped.resolve()
  built_in = cli.load_run_config(None, ["trainer.steps=3"])
  assert f"running the quickstart ({shipped})" in capsys.readouterr().out
  from_file = load_config(shipped, ["trainer.steps=3"])
  assert dataclasses.asdict(built_in) == dataclasses.asdict(from_file)
  assert built_in.methods() == ["lora", "anlr"] and built_in.eval.include_base


@pytest.mark.slow
def test_short_quickstart_writes_table_results_metrics_and_plot(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(REPO)  # `anlr train` with no --config finds configs/quickstart.yaml here
  steps = 4
  assert (
      cli.main(
          [
              "train",
              f"run_dir={tmp_path}/qs-{{timestamp}}",
              f"trainer.steps={steps}",
              "trainer.devices=1",
              "anlr.warmup_steps=2",  # below the run's 4 updates, or AnLR would never switch on
              "trainer.log_every=1",
              "eval.limit=16",
              "eval.batch_size=16",
          ]
      )
      == 0
  )
  out = capsys.readouterr().out
  assert "running the quickstart" in out
  (run_dir,) = list(tmp_path.iterdir())
  assert run_dir.name.startswith("qs-")

  summary = json.loads((run_dir / "summary.json").read_text())
  assert [r["method"] for r in summary["runs"]] == ["lora", "anlr"]
  with open(run_dir / "accuracy.csv") as f:
    table = list(csv.reader(f))
  assert table[0] == ["Method", TASKS[QUICKSTART_TASK].title, "Avg."]
  assert [row[0] for row in table[1:]] == ["base", "lora", "anlr"]
  assert (run_dir / "accuracy.md").is_file() and (run_dir / "loss.png").stat().st_size > 1000
  printed = [
      line.split()
      for line in out.splitlines()
      if line.strip().startswith(("base ", "lora ", "anlr "))
  ]
  assert [p[0] for p in printed] == ["base", "lora", "anlr"]

  curves = {}
  for method in ("lora", "anlr"):
    sub = run_dir / method
    results = json.loads((sub / "results.json").read_text())
    assert results["method"] == method and results["seed"] == 0 and results["steps"] == steps
    acc = results["accuracy"][QUICKSTART_TASK]
    records = [
        json.loads(l) for l in (sub / f"eval_{QUICKSTART_TASK}.jsonl").read_text().splitlines()
    ]
    assert len(records) == 16 and acc == pytest.approx(np.mean([r["correct"] for r in records]))
    assert f"{100 * acc:.1f}" == dict((p[0], p[1]) for p in printed)[method]
    rows = [json.loads(l) for l in (sub / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    curves[method] = [r["loss"] for r in rows]
    assert (sub / "lora_final.safetensors").is_file() and (sub / "loss.png").is_file()
  # Same seed, data and steps: the first update (before any AnLR warmup ends) is identical.
  assert curves["lora"][0] == pytest.approx(curves["anlr"][0], rel=1e-6)
  assert all(np.isfinite(curves["lora"] + curves["anlr"]))
