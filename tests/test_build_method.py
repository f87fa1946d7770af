"""``build_method``: the one assembly of a method's run (adapter layers, optimizer, schedule, hooks)
that ``anlr train``, the examples, the benchmarks and the test helpers share; the GPU-mesh example
trains the baselines it used to get wrong (LoRA-Dash, AdaLoRA, LoRA-Pro) on a CPU mesh."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors import safe_open

from anlr_jax import assets
from anlr_jax.app.config import load_config
from anlr_jax.app.assemble import build_method
from anlr_jax.methods import METHOD_NAMES, get_method
from anlr_jax.settings import ConfigError
from anlr_jax.models import LlamaForCausalLM, ModelConfig
from anlr_jax.nn import iter_adalora_layers, iter_lora_layers
from anlr_jax.nn.loradash import LoRADashLinear
from anlr_jax.optim.adalora import RankAllocatorState

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "finetune_llama_gpu_mesh.py")


def _tiny_model():
  config = ModelConfig.preset(
      "tiny",
      vocab_size=32,
      hidden_size=16,
      intermediate_size=32,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=2,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
  )
  return LlamaForCausalLM(config, rngs=nnx.Rngs(0))


def _config(*overrides):
  return load_config(None, ["lora.rank=4", "lora.targets=[q_proj,v_proj]", *overrides])


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_build_method_injects_the_layer_and_builds_an_optimizer_for_every_method(method):
  model = _tiny_model()
  config = _config(f"method={method}", "anlr.warmup_steps=1", "loradash.launch_step=1")
  built = build_method(config, total_steps=5, model=model)
  spec = get_method(method)
  assert built.spec == spec and built.total_steps == 5
  adapters = dict(iter_adalora_layers(model) if spec.uses_adalora else iter_lora_layers(model))
  assert len(adapters) == 2  # q_proj and v_proj of the one layer
  dash = [isinstance(layer, LoRADashLinear) for layer in adapters.values()]
  assert all(dash) if spec.uses_loradash else not any(dash)
  state = built.tx.init(nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)))
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, RankAllocatorState))
  assert any(isinstance(x, RankAllocatorState) for x in leaves) == spec.uses_adalora
  assert ("loss_regularizer" in built.hooks) == spec.uses_adalora
  assert ("on_step" in built.hooks) == spec.uses_loradash


def test_build_method_takes_every_constant_from_the_config():
  config = _config(
      "trainer.learning_rate=0.01",
      "trainer.lr_warmup_steps=2",
      "trainer.weight_decay=0.1",
      "trainer.clip_norm=0.5",
      "adalora.target_r=2",
      "method=lora",
  )
  built = build_method(config, total_steps=10)
  # the trainer's linear warmup/decay over the run's updates
  np.testing.assert_allclose([built.schedule(t) for t in (0, 1, 2, 6)], [0.0, 0.005, 0.01, 0.005])
  params = {"a": {"lora_a": np.ones((3, 2), np.float32), "lora_b": np.ones((2, 3), np.float32)}}
  grads = jax.tree.map(lambda x: 4.0 * x, params)
  reference = optax.chain(
      optax.clip_by_global_norm(0.5), optax.adamw(built.schedule, weight_decay=0.1)
  )
  updates = {}
  for name, tx in (("built", built.tx), ("reference", reference)):
    state, update = tx.init(params), jax.jit(tx.update)  # one program, not op-by-op dispatch
    for _ in range(3):
      updates[name], state = update(grads, state, params)
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
      updates["built"],
      updates["reference"],
  )
  assert np.any(np.asarray(updates["built"]["a"]["lora_a"]) != 0)
  fixed = build_method(config, total_steps=10, learning_rate=0.25)
  assert fixed.schedule == 0.25


def test_build_method_refuses_a_phase_that_never_starts():
  with pytest.raises(ConfigError, match="loradash.launch_step=100"):
    build_method(_config("method=loradash"), total_steps=50)
  with pytest.raises(ConfigError, match="anlr.warmup_steps=100"):
    build_method(_config("method=anlr"), total_steps=50)
  notes = []
  lora = _config("method=lora", "trainer.lr_warmup_steps=80")
  build_method(lora, total_steps=50, log=notes.append)
  assert notes and "trainer.lr_warmup_steps=80" in notes[0]
  assert build_method(_config("method=anlr"), total_steps=50, check=False).total_steps == 50


def test_build_method_without_total_steps_builds_the_layers_alone():
  model = _tiny_model()
  built = build_method(_config("method=dora"), model=model)
  assert built.tx is None and built.schedule is None and built.hooks == {}
  layers = dict(iter_lora_layers(model))
  assert len(layers) == 2 and all(layer.use_dora for layer in layers.values())
  with pytest.raises(ValueError, match="needs a model"):
    build_method(_config())


def _example(monkeypatch):
  """The GPU-mesh example as a module, to run in this process (no multi-process job configured)."""
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  spec = importlib.util.spec_from_file_location("finetune_llama_gpu_mesh", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run_examples(runs, devices):
  """The example's ``main`` on each argument list of ``runs``, one after the other in one fresh
  process (tests/helpers/run_scripts.py) on ``devices`` fake CPU devices."""
  env = dict(
      os.environ,
      PYTHONPATH=REPO,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}",
  )
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(var, None)
  scripts = json.dumps([[EXAMPLE, args] for args in runs])
  return subprocess.run(
      [sys.executable, "-m", "tests.helpers.run_scripts", scripts],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )


def _example_args(out, method):
  root = assets.quickstart_dir()
  args = ["--model", str(root), "--data", str(root / assets.TRAIN_FILE), "--out", str(out)]
  args += ["--mesh-data", "2", "--mesh-fsdp", "1", "--dtype", "float32", "--rank", "4"]
  args += ["--alpha", "8", "--global-batch", "8", "--max-length", "64", "--save-every", "0"]
  return args + ["--steps", "3", "--method", method, "--remat", "none"]


@pytest.mark.slow
def test_gpu_mesh_example_trains_the_baselines_with_their_own_layers_and_optimizers(tmp_path):
  """LoRA-Dash launches and trains its directions; AdaLoRA trains SVD-form adapters and exports a
  PEFT AdaLoRA adapter: one run after the other in one process on a 2-device data-parallel mesh
  (LoRA-Pro and the rest get their optimizers from the same build_method, tested above). Two
  devices, not more: on a 2-core machine XLA's CPU client runs the fake devices on a pool of 2
  threads, and collectives over sub-groups of 4 devices can starve there until XLA's 40 s
  rendezvous limit aborts them (and the pytest process's 8 devices train the same steps at twice
  this CPU time)."""
  args = ["--set", "loradash.launch_step=1", "--set", "adalora.target_r=2"]
  methods = ("loradash", "adalora")
  # both runs in one process: one interpreter start, the small programs they share compiled once
  proc = _run_examples([_example_args(tmp_path / m, m) + args for m in methods], devices=2)
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = proc.stdout.split(" processes, 2 devices, mesh ")[1:]  # each run's output
  assert len(printed) == len(methods), proc.stdout
  for method, stdout in zip(methods, printed):
    out = tmp_path / method
    with safe_open(str(out / "lora_final.safetensors"), framework="numpy") as f:
      keys = list(f.keys())
      tensors = {k: f.get_tensor(k) for k in keys}
    if method == "loradash":
      scales = [v for k, v in tensors.items() if k.endswith("dash_scale")]
      directions = [v for k, v in tensors.items() if k.endswith("dash_u")]
      assert scales and directions and all(np.any(d != 0) for d in directions)
      assert any(np.any(s != 0) for s in scales)  # trained after the launch at update 1
      assert "anlr export" in stdout
    elif method == "adalora":
      assert any(k.endswith("lora_e") for k in keys)
      config = json.loads((out / "adapter" / "adapter_config.json").read_text())
      assert config["peft_type"] == "ADALORA"
    assert load_config(str(out / "config.yaml")).method == method


def test_gpu_mesh_example_refuses_a_bad_method_in_one_line(tmp_path, capsys, monkeypatch):
  assert _example(monkeypatch).main(_example_args(tmp_path / "run", "qlora")) == 2
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "method" in lines[0] and "qlora" in lines[0], err
  assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_anlr_train_assembles_each_method_once_through_build_method(tmp_path, monkeypatch):
  """``anlr train`` (two methods compared; then again, one of them trained but without results;
  then ``anlr eval`` of a run): each method's config is made and its inputs checked once per
  command, and every model is adapted by ``build_method`` alone, once. The trainer is replaced by
  one that trains nothing (the CLI tests train for real)."""
  import collections

  class Untrained:  # the Trainer's interface as _train uses it, without a compiled step
    step = 0

    def __init__(self, model, *args, **kwargs):
      self.model = model

    def run(self):
      return [{"step": 1, "loss": 1.0}]

    def close(self):
      pass

    def updated_model(self):
      return self.model

  from anlr_jax.app import assemble as app_methods
  from anlr_jax.app import train as app_train
  from anlr_jax.app.model import load_adapted_model
  from tests.helpers.tiny_run import tiny_run_setup

  calls = collections.Counter()

  def counted(module, name):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
      calls[name] += 1
      if name == "build_method" and kwargs.get("model") is not None:
        calls["build_method(model)"] += 1
      return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)

  counted(app_train, "_check_inputs")
  counted(app_train, "_method_config")
  counted(app_train, "build_method")
  counted(app_methods, "inject_method")  # the layers: build_method's, called by it alone
  monkeypatch.setattr(app_train, "Trainer", Untrained)
  monkeypatch.setattr(app_train, "plot_losses", lambda *args: None)  # nothing trained to draw
  overrides = ["compare=[lora,anlr]", "trainer.steps=2", "eval.tasks={}"]
  config = load_config(str(tiny_run_setup(tmp_path, n_test=0)), overrides)
  app_train.train_run(config, log=lambda _: None, timestamp="t")
  assert calls == {
      "_check_inputs": 2,
      "_method_config": 2,
      "build_method": 2,
      "build_method(model)": 2,
      "inject_method": 2,
  }
  (run_dir,) = (tmp_path / "runs").iterdir()
  (run_dir / "lora" / "results.json").unlink()  # lora: trained, its adapter loaded again
  calls.clear()
  app_train.train_run(config, log=lambda _: None, timestamp="t")
  assert calls == {
      "_check_inputs": 2,
      "_method_config": 2,
      "build_method": 1,
      "build_method(model)": 1,
      "inject_method": 1,
  }
  calls.clear()
  model, _, _ = load_adapted_model(config, str(run_dir / "anlr"))  # anlr eval --adapter
  assert calls == {"inject_method": 1}
  assert len(list(iter_lora_layers(model))) == 2 * 5
