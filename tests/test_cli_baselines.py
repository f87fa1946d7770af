"""`anlr sweep` / `anlr train|eval|export` for adalora, lorapro, loradash, anlr+loradash end to end
on a tiny random HF LLaMA (tests/test_cli.py's setup); plain lora and loraplus train beside them."""

import json
import re

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from anlr_jax.app import cli
from anlr_jax.app.config import load_config
from anlr_jax.rundir import LORA_FILE
from anlr_jax.app.model import load_adapted_model
from tests.helpers.fresh_process import run_helper
from tests.helpers.tiny_run import tiny_run_setup

METHODS = ("lora", "loraplus", "adalora", "lorapro", "loradash", "anlr+loradash")
STEPS = 6
OVERRIDES = (
    f"trainer.steps={STEPS}",
    "adalora.target_r=2",  # of lora.rank 4: half the triplets are pruned by the end
    "loradash.launch_step=2",
    "loradash.num_directions=4",
    "loraplus.lr_ratio=4",
)
Q = "model.layers.0.self_attn.q_proj"
pytestmark = pytest.mark.slow  # the module's fixture trains six methods


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
  """Every method trained by `anlr sweep`, each cell through the `anlr train` command line the
  sweep builds, all cells in one process of their own (tests/helpers/sweep_in_process.py): a fresh
  interpreter on one CPU device, as `anlr sweep` runs its cells, where this test process's 8 devices
  would shard every train step 8 ways and compile it for them (~14 s more CPU)."""
  root = tmp_path_factory.mktemp("baselines")
  config = tiny_run_setup(root)
  argv = ["--config", str(config), "--methods", ",".join(METHODS), "--lrs", "5e-3"]
  argv += ["--out", str(root / "sweep"), *OVERRIDES]
  run_helper("sweep_in_process", str(root / "commands.json"), *argv)
  commands = json.loads((root / "commands.json").read_text())
  assert all(c[1:4] == ["-m", "anlr_jax", "train"] for c in commands), commands
  assert [c[c.index("train") + 4] for c in commands] == [f"method={m}" for m in METHODS]
  cells = {m: root / "sweep" / m / "lr0.005" / "seed0" for m in METHODS}
  return root, config, cells


def _rows(run_dir):
  return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _generations(path):
  return [json.loads(l)["generation"] for l in path.read_text().splitlines()]


def test_every_method_trains_and_writes_results(swept):
  root, _, cells = swept
  for method, run_dir in cells.items():
    results = json.loads((run_dir / "results.json").read_text())
    assert results["method"] == method and results["steps"] == STEPS
    assert 0.0 <= results["accuracy"]["winogrande"] <= 1.0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), method
    assert all(np.isfinite(r["loss"]) for r in rows), method
  summary = (root / "sweep" / "summary.md").read_text()
  assert all(f"| {m} |" in summary for m in METHODS), summary
  identity = json.loads((cells["loradash"] / "results.json").read_text())["identity"]
  assert identity["loradash.launch_step"] == 2 and identity["loradash.num_directions"] == 4
  identity = json.loads((cells["loraplus"] / "results.json").read_text())["identity"]
  assert identity["loraplus.lr_ratio"] == 4


def test_adalora_prunes_to_its_budget_and_regularises(swept):
  _, _, cells = swept
  run_dir = cells["adalora"]
  tensors = load_file(run_dir / LORA_FILE)
  e = np.concatenate([v for k, v in tensors.items() if k.endswith("/lora_e")])
  modules = 2 * 5  # 2 layers x the paper's 5 targets
  assert e.size == 4 * modules
  kept = int(np.count_nonzero(e))
  assert 0 < kept <= 2 * modules  # the final budget: target_r x modules
  assert tensors[f"{Q}/lora_a"].shape == (32, 4) and tensors[f"{Q}/lora_b"].shape == (4, 32)
  rows = _rows(run_dir)
  assert all(r["regularizer"] > 0 for r in rows)  # AdaLoRA's orthogonal regulariser is in the loss
  assert "regularizer" not in _rows(cells["lora"])[0]
  identity = json.loads((run_dir / "results.json").read_text())["identity"]
  assert identity["adalora.target_r"] == 2 and identity["adalora.orth_reg_weight"] == 0.5


def test_adalora_exports_to_peft_and_merged(swept, tmp_path):
  from peft import PeftModel

  root, config, cells = swept
  run_dir = cells["adalora"]
  out = tmp_path / "peft"
  assert cli.main(["export", "--run", str(run_dir), "--format", "peft", "--out", str(out)]) == 0
  adapter_config = json.loads((out / "adapter_config.json").read_text())
  assert adapter_config["peft_type"] == "ADALORA" and adapter_config["total_step"] == STEPS
  assert adapter_config["init_r"] == 4 and adapter_config["target_r"] == 2
  kept = sum(sum(v) for v in adapter_config["rank_pattern"].values())
  assert kept == np.count_nonzero(
      [v for k, v in load_file(run_dir / LORA_FILE).items() if k.endswith("/lora_e")]
  )
  ids = np.random.default_rng(1).integers(3, 200, size=(2, 12))
  hf = transformers.LlamaForCausalLM.from_pretrained(root / "model").eval()
  peft_model = PeftModel.from_pretrained(hf, out).eval()
  with torch.no_grad():
    torch_logits = peft_model(input_ids=torch.tensor(ids)).logits.numpy()
  model, _, _ = load_adapted_model(load_config(config), str(run_dir))
  chex.assert_trees_all_close(
      np.asarray(model(jnp.asarray(ids))), torch_logits, atol=1e-4, rtol=1e-4
  )
  # the PEFT adapter directory loads back in `anlr eval` and scores as the run did
  ev = tmp_path / "eval"
  argv = ["eval", "--config", str(config), "--adapter", str(out), "--out", str(ev)]
  assert cli.main(argv) == 0
  results = json.loads((run_dir / "results.json").read_text())
  assert json.loads((ev / "results.json").read_text())["accuracy"] == results["accuracy"]

  merged = tmp_path / "merged"
  assert (
      cli.main(["export", "--run", str(run_dir), "--format", "merged", "--out", str(merged)]) == 0
  )
  with torch.no_grad():
    merged_logits = transformers.LlamaForCausalLM.from_pretrained(merged)(
        input_ids=torch.tensor(ids)
    ).logits.numpy()
  chex.assert_trees_all_close(merged_logits, torch_logits, atol=1e-4, rtol=1e-4)


def test_lorapro_trains_otherwise_than_lora(swept):
  _, _, cells = swept
  lora, pro = (load_file(cells[m] / LORA_FILE) for m in ("lora", "lorapro"))
  assert set(lora) == set(pro)
  diff = max(np.abs(lora[k] - pro[k]).max() for k in lora)
  assert diff > 1e-3, diff
  loss = lambda m: [r["loss"] for r in _rows(cells[m])]  # noqa: E731
  assert loss("lora")[0] == pytest.approx(loss("lorapro")[0])  # same init and first batch
  assert loss("lora")[1:] != pytest.approx(loss("lorapro")[1:])


def test_loradash_launches_and_eval_reproduces_the_run(swept, tmp_path):
  _, config, cells = swept
  run_dir = cells["loradash"]
  tensors = load_file(run_dir / LORA_FILE)
  assert tensors[f"{Q}/dash_u"].shape == (32, 4) and tensors[f"{Q}/dash_v"].shape == (4, 32)
  assert tensors[f"{Q}/dash_index"].dtype == np.int32 and (tensors[f"{Q}/dash_index"] >= 0).all()
  assert np.abs(tensors[f"{Q}/dash_scale"]).max() > 0  # trained after the launch at update 2
  out = tmp_path / "eval"
  assert (
      cli.main(["eval", "--config", str(config), "--adapter", str(run_dir), "--out", str(out)]) == 0
  )
  ev = json.loads((out / "results.json").read_text())
  assert ev["accuracy"] == json.loads((run_dir / "results.json").read_text())["accuracy"]
  name = "eval_winogrande.jsonl"
  assert _generations(out / name) == _generations(run_dir / name)


def test_loradash_exports_merged_only(swept, tmp_path, capsys):
  from anlr_jax.nn import iter_loradash_layers

  _, config, cells = swept
  run_dir = cells["loradash"]
  argv = ["export", "--run", str(run_dir), "--format", "peft", "--out", str(tmp_path / "p")]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "no PEFT adapter format" in err and "--format merged" in err
  assert not (tmp_path / "p").exists()

  merged = tmp_path / "merged"
  assert (
      cli.main(["export", "--run", str(run_dir), "--format", "merged", "--out", str(merged)]) == 0
  )
  ids = np.random.default_rng(2).integers(3, 200, size=(2, 12))
  with torch.no_grad():
    merged_logits = transformers.LlamaForCausalLM.from_pretrained(merged)(
        input_ids=torch.tensor(ids)
    ).logits.numpy()
  model, _, _ = load_adapted_model(load_config(config), str(run_dir))
  jax_logits = np.asarray(model(jnp.asarray(ids)))
  chex.assert_trees_all_close(merged_logits, jax_logits, atol=1e-5, rtol=1e-5)
  for _, layer in iter_loradash_layers(model):
    layer.dash_scale[...] = jnp.zeros_like(layer.dash_scale[...])
  without_dash = np.asarray(model(jnp.asarray(ids)))
  assert np.abs(merged_logits - without_dash).max() > 1e-5  # the merged kernel has the dash term


def test_anlr_loradash_uses_anlr(swept):
  _, _, cells = swept
  rows = _rows(cells["anlr+loradash"])
  spread = [r["anlr/multiplier_max_min"] for r in rows]
  assert spread[0] == pytest.approx(1.0)  # anlr.warmup_steps = 1: uniform at the first update
  assert min(spread[1:]) > 1.05, spread  # per-rank multipliers after the warmup
  assert "anlr/multiplier_max_min" not in _rows(cells["loradash"])[0]
  dash = load_file(cells["anlr+loradash"] / LORA_FILE)
  assert np.abs(dash[f"{Q}/dash_scale"]).max() > 0


def test_errors_name_the_key(swept, tmp_path, capsys):
  _, config, _ = swept
  base = ["train", "--config", str(config), f"run_dir={tmp_path}/{{method}}", *OVERRIDES]
  cases = [
      (
          ["method=loradash", f"loradash.launch_step={STEPS}"],
          f"loradash.launch_step={STEPS} is not below the run's {STEPS} updates: the dash phase"
          " would never start",
      ),
      (["method=adalora", "adalora.target_r=8"], "adalora.target_r=8 exceeds lora.rank=4"),
      (
          ["method=adalora", "adalora.tinit=4", "adalora.tfinal=2"],
          "adalora.tinit \\+ adalora.tfinal = 4 \\+ 2 is not below the run's 6 updates",
      ),
      (["method=lorapro", "lorapro.mode=exact"], "lorapro.mode: 'exact' is not allowed"),
      (
          ["method=loradash", "loradash.num_directions=40"],
          "loradash.num_directions=40: .*exceeds min\\(d_in, d_out\\) = \\d+",
      ),
  ]
  for overrides, pattern in cases:
    assert cli.main(base + overrides) == 2, overrides
    err = capsys.readouterr().err
    assert re.search(pattern, err), (overrides, err)
