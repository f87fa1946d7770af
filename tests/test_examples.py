"""The scripts in ``examples/`` run as their docstrings say (few steps, shipped model and data).

``finetune_llama_gpu_mesh.py`` is written for GPU meshes; here it runs on 4 fake CPU devices as a
2 x 2 ``data x fsdp`` mesh, resumes from its own checkpoints when re-run, and writes a PEFT adapter.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from safetensors.numpy import load_file

from anlr_jax import assets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, devices=1):
  env = dict(
      os.environ,
      PYTHONPATH=REPO,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}",
  )
  proc = subprocess.run(
      [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.slow
def test_quickstart_example_trains_and_scores_the_test_set():
  out = _run(["examples/finetune_quickstart.py", "--method", "anlr", "--steps", "4"])
  loss = re.search(r"anlr: loss ([0-9.]+) -> ([0-9.]+)", out)
  acc = re.search(r"test accuracy: (\d+)/(\d+) = ", out)
  assert loss and acc, out
  n_test = len(json.loads((assets.quickstart_dir() / assets.TEST_FILE).read_text()))
  assert int(acc.group(2)) == n_test and 0 <= int(acc.group(1)) <= n_test


@pytest.mark.slow
def test_gpu_mesh_example_runs_on_a_cpu_mesh_resumes_and_exports_a_peft_adapter(tmp_path):
  root = assets.quickstart_dir()
  out_dir = tmp_path / "run"
  args = ["examples/finetune_llama_gpu_mesh.py", "--model", str(root)]
  args += ["--data", str(root / assets.TRAIN_FILE), "--out", str(out_dir)]
  args += ["--mesh-data", "2", "--mesh-fsdp", "2", "--dtype", "float32", "--rank", "4"]
  args += ["--alpha", "8", "--global-batch", "8", "--max-length", "64", "--save-every", "2"]
  # no recomputation in the backward pass: a quarter of the step's compile time (remat itself is
  # checked in tests/test_models_llama.py and tests/test_lean_loss.py)
  args += ["--remat", "none"]
  args += ["--set", "anlr.warmup_steps=1"]  # as in anlr train, AnLR must switch on within the run
  first = _run(args + ["--steps", "2"], devices=4)
  assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 1}" in first, first
  # re-run with more steps: resumes from step 2 (a longer schedule has to be allowed by name)
  _run(args + ["--steps", "4", "--resume-allow", "trainer.steps"], devices=4)
  steps = [
      json.loads(line)["step"]
      for line in (out_dir / "metrics.jsonl").read_text().split("\n")
      if line
  ]
  assert steps == [1, 2, 3, 4]
  assert sorted(p for p in os.listdir(out_dir / "ckpt") if p[0] != ".") == ["2", "4"]
  adapter = out_dir / "adapter"
  config = json.loads((adapter / "adapter_config.json").read_text())
  assert config["r"] == 4 and config["lora_alpha"] == 8
  assert sorted(config["target_modules"]) == ["down_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
  layers = json.loads((root / "config.json").read_text())["num_hidden_layers"]
  tensors = load_file(adapter / "adapter_model.safetensors")
  assert len(tensors) == 2 * 5 * layers
  assert all(("lora_A" in k) != ("lora_B" in k) for k in tensors)
