"""PEFT adapter export/import against peft + torch on toy models with matching module names."""

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import anlr_jax
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from anlr_jax.nn.inject import inject_lora, iter_lora_layers
from anlr_jax.nn.lora import LoRALinear
from anlr_jax.nn.peft_io import export_peft_adapter, import_peft_adapter
from tests.helpers.cim_torch import torch_one_thread  # noqa: F401  (autouse)
from tests.helpers.tiny_llama import tiny_llama_config

D, H, V = 8, 12, 5


# ---------------------------------------------------------------------------- toy twins
class NnxAttn(nnx.Module):

  def __init__(self, rngs):
    self.q_proj = nnx.Linear(D, D, rngs=rngs)
    self.k_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.v_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.o_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.o_proj(jnp.tanh(self.q_proj(x)) * self.v_proj(x) + jax.nn.sigmoid(self.k_proj(x)))


class NnxMlp(nnx.Module):

  def __init__(self, rngs):
    self.up_proj = nnx.Linear(D, H, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(H, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.up_proj(x)))


class NnxLayer(nnx.Module):

  def __init__(self, rngs):
    self.self_attn = NnxAttn(rngs)
    self.mlp = NnxMlp(rngs)

  def __call__(self, x):
    x = x + self.self_attn(x)
    return x + self.mlp(x)


class NnxToy(nnx.Module):

  def __init__(self, rngs):
    self.layers = nnx.List([NnxLayer(rngs) for _ in range(2)])
    self.lm_head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(x)


class TorchAttn(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.q_proj = torch.nn.Linear(D, D)
    self.k_proj = torch.nn.Linear(D, D, bias=False)
    self.v_proj = torch.nn.Linear(D, D, bias=False)
    self.o_proj = torch.nn.Linear(D, D, bias=False)

  def forward(self, x):
    return self.o_proj(torch.tanh(self.q_proj(x)) * self.v_proj(x) + torch.sigmoid(self.k_proj(x)))


class TorchMlp(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.up_proj = torch.nn.Linear(D, H, bias=False)
    self.down_proj = torch.nn.Linear(H, D, bias=False)

  def forward(self, x):
    return self.down_proj(torch.nn.functional.silu(self.up_proj(x)))


class TorchLayer(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.self_attn = TorchAttn()
    self.mlp = TorchMlp()

  def forward(self, x):
    x = x + self.self_attn(x)
    return x + self.mlp(x)


class TorchToy(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.layers = torch.nn.ModuleList([TorchLayer() for _ in range(2)])
    self.lm_head = torch.nn.Linear(D, V)

  def forward(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(x)


def _nnx_model():
  model = NnxToy(nnx.Rngs(0))
  for i, (_, m) in enumerate(sorted(nnx.iter_modules(model), key=lambda t: str(t[0]))):
    if isinstance(m, nnx.Linear) and m.bias is not None:
      m.bias[...] = 0.1 * jax.random.normal(jax.random.key(50 + i), m.bias.shape)
  return model


def _torch_twin(nnx_model):
  """A TorchToy with the NNX base weights (kernel (in, out) -> weight (out, in))."""
  torch_model = TorchToy()
  with torch.no_grad():
    for path, m in nnx.iter_modules(nnx_model):
      if isinstance(m, nnx.Linear) and not (path and path[-1] == "base"):
        target = torch_model.get_submodule(".".join(map(str, path)))
        target.weight.copy_(torch.tensor(np.asarray(m.kernel[...]).T))
        if m.bias is not None:
          target.bias.copy_(torch.tensor(np.asarray(m.bias[...])))
  return torch_model.eval()


def _fake_training(model, seed=1):
  """Move every adapter factor away from its init, as training would."""
  key = jax.random.key(seed)
  for _, layer in iter_lora_layers(model):
    key, ka, kb, km = jax.random.split(key, 4)
    layer.lora_a[...] = layer.lora_a[...] + 0.2 * jax.random.normal(ka, layer.lora_a.shape)
    layer.lora_b[...] = layer.lora_b[...] + 0.2 * jax.random.normal(kb, layer.lora_b.shape)
    if layer.use_dora:
      layer.lora_magnitude[...] = layer.lora_magnitude[...] * (
          1 + 0.1 * jax.random.normal(km, layer.lora_magnitude.shape)
      )


def _x():
  return np.asarray(jax.random.normal(jax.random.key(7), (2, 3, D)))


def _peft_outputs(torch_model, adapter_dir, x):
  from peft import PeftModel

  peft_model = PeftModel.from_pretrained(torch_model, adapter_dir).eval()
  with torch.no_grad():
    return peft_model(torch.tensor(x)).numpy(), peft_model


def _tensor_bytes(path):
  return {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in load_file(path).items()}


VARIANTS = [
    dict(),
    dict(use_rslora=True),
    dict(use_dora=True),
    dict(init="pissa"),
    dict(init="milora", use_rslora=True),
    dict(init="pissa", use_dora=True),
]


@pytest.mark.parametrize(
    "kwargs", VARIANTS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()) or "lora"
)
def test_export_matches_peft_and_roundtrips_byte_identical(tmp_path, kwargs):
  model = _nnx_model()
  torch_model = _torch_twin(model)  # original W0, before PiSSA/MiLoRA rewrite it
  inject_lora(model, rank=2, alpha=6.0, dropout=0.0, rngs=nnx.Rngs(3), **kwargs)
  _fake_training(model)
  x = _x()
  y = np.asarray(model(x))
  export_peft_adapter(model, tmp_path / "a", task_type=None)

  torch_out, peft_model = _peft_outputs(torch_model, tmp_path / "a", x)
  chex.assert_trees_all_close(torch_out, y, atol=1e-5, rtol=1e-5)
  config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
  pissa_like = kwargs.get("init", "default") != "default"
  assert config["r"] == (4 if pissa_like else 2)
  assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"])
  assert peft_model.peft_config["default"].use_dora == kwargs.get("use_dora", False)

  # Import into a fresh model holding the original weights, then export again.
  fresh = _nnx_model()
  import_peft_adapter(fresh, tmp_path / "a")
  chex.assert_trees_all_close(fresh(x), y, atol=1e-5, rtol=1e-5)
  export_peft_adapter(fresh, tmp_path / "b", task_type=None)
  first, second = (_tensor_bytes(tmp_path / d / "adapter_model.safetensors") for d in ("a", "b"))
  assert first == second
  assert json.loads((tmp_path / "b" / "adapter_config.json").read_text()) == config


def test_keys_and_layouts_match_peft_save(tmp_path):
  """Our file has the key set, shapes and config values PEFT itself writes for the same model."""
  from peft import LoraConfig, get_peft_model

  model = _nnx_model()
  torch_model = _torch_twin(model)
  inject_lora(
      model,
      target_modules=("q_proj", "down_proj"),
      rank=3,
      alpha=5.0,
      use_dora=True,
      rngs=nnx.Rngs(1),
  )
  export_peft_adapter(model, tmp_path / "ours", base_model_name_or_path="toy", task_type=None)
  peft_model = get_peft_model(
      torch_model,
      LoraConfig(
          r=3,
          lora_alpha=5,
          lora_dropout=0.05,
          target_modules=["q_proj", "down_proj"],
          use_dora=True,
      ),
  )
  peft_model.save_pretrained(tmp_path / "peft")
  ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
  theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
  assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
  assert all(v.dtype == np.float32 for v in ours.values())
  ours_cfg = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
  theirs_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
  for key in (
      "peft_type",
      "r",
      "lora_alpha",
      "lora_dropout",
      "use_rslora",
      "use_dora",
      "fan_in_fan_out",
      "bias",
  ):
    assert ours_cfg[key] == theirs_cfg[key], key
  assert sorted(ours_cfg["target_modules"]) == sorted(theirs_cfg["target_modules"])
  assert ours_cfg["base_model_name_or_path"] == "toy"


def test_partial_injection_exports_full_paths(tmp_path):
  model = _nnx_model()
  torch_model = _torch_twin(model)
  inject_lora(model.layers[1], target_modules=("v_proj",), rank=2, alpha=2.0, rngs=nnx.Rngs(1))
  _fake_training(model)
  export_peft_adapter(model, tmp_path, task_type=None)
  config = json.loads((tmp_path / "adapter_config.json").read_text())
  assert config["target_modules"] == ["layers.1.self_attn.v_proj"]
  torch_out, peft_model = _peft_outputs(torch_model, tmp_path, _x())
  assert isinstance(peft_model.base_model.model.layers[0].self_attn.v_proj, torch.nn.Linear)
  assert not type(peft_model.base_model.model.layers[0].self_attn.v_proj).__module__.startswith(
      "peft"
  )
  chex.assert_trees_all_close(torch_out, np.asarray(model(_x())), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_dora", [False, True])
def test_import_adapter_written_by_peft(tmp_path, use_dora):
  from peft import LoraConfig, get_peft_model

  model = _nnx_model()
  torch_model = _torch_twin(model)
  peft_model = get_peft_model(
      torch_model,
      LoraConfig(
          r=2,
          lora_alpha=4,
          target_modules=["q_proj", "up_proj"],
          use_dora=use_dora,
          init_lora_weights=False,
      ),
  )
  with torch.no_grad():  # init_lora_weights=False gives a random, non-zero B
    for name, p in peft_model.named_parameters():
      if "lora_magnitude" in name:
        p.mul_(1.1)
  peft_model.save_pretrained(tmp_path)
  peft_model.eval()
  x = _x()
  with torch.no_grad():
    expected = peft_model(torch.tensor(x)).numpy()
  import_peft_adapter(model, tmp_path)
  assert sorted(p for p, _ in iter_lora_layers(model)) == sorted(
      f"layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.up_proj")
  )
  chex.assert_trees_all_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_import_into_already_injected_model(tmp_path):
  src = _nnx_model()
  inject_lora(src, rank=2, alpha=4.0, rngs=nnx.Rngs(1))
  _fake_training(src)
  export_peft_adapter(src, tmp_path)
  dst = inject_lora(_nnx_model(), rank=2, alpha=4.0, rngs=nnx.Rngs(9))
  import_peft_adapter(dst, tmp_path)
  chex.assert_trees_all_close(dst(_x()), src(_x()), atol=1e-6)
  wrong_rank = inject_lora(_nnx_model(), rank=3, alpha=4.0, rngs=nnx.Rngs(9))
  with pytest.raises(ValueError, match="settings"):
    import_peft_adapter(wrong_rank, tmp_path)
  partial = inject_lora(
      _nnx_model(), target_modules=("q_proj", "o_proj"), rank=2, alpha=4.0, rngs=nnx.Rngs(9)
  )
  with pytest.raises(ValueError, match="o_proj"):
    import_peft_adapter(partial, tmp_path)


def test_import_errors_name_the_problem(tmp_path):
  src = _nnx_model()
  inject_lora(src, rank=2, alpha=4.0, rngs=nnx.Rngs(1))
  export_peft_adapter(src, tmp_path / "ok")
  weights = load_file(tmp_path / "ok" / "adapter_model.safetensors")
  config = (tmp_path / "ok" / "adapter_config.json").read_text()

  def write(name, tensors, cfg=config):
    os.makedirs(tmp_path / name)
    save_file(tensors, tmp_path / name / "adapter_model.safetensors")
    (tmp_path / name / "adapter_config.json").write_text(cfg)
    return tmp_path / name

  with pytest.raises(FileNotFoundError, match="adapter_config.json"):
    import_peft_adapter(_nnx_model(), tmp_path / "nowhere")
  key_b = "base_model.model.layers.0.mlp.up_proj.lora_B.weight"
  missing = write("missing", {k: v for k, v in weights.items() if k != key_b})
  with pytest.raises(KeyError, match="layers.0.mlp.up_proj.lora_B.weight"):
    import_peft_adapter(_nnx_model(), missing)
  bad_shape = write("shape", {**weights, key_b: np.zeros((H + 1, 2), np.float32)})
  with pytest.raises(ValueError, match=r"up_proj.lora_B.weight' has shape \(13, 2\)"):
    import_peft_adapter(_nnx_model(), bad_shape)
  stray = write(
      "stray",
      {
          **weights,
          "base_model.model.layers.5.mlp.up_proj.lora_A.weight": np.zeros((2, D), np.float32),
      },
  )
  with pytest.raises(KeyError, match="layers.5"):
    import_peft_adapter(_nnx_model(), stray)
  pissa_cfg = json.loads(config)
  pissa_cfg["init_lora_weights"] = "pissa"
  pissa = write("pissa", weights, json.dumps(pissa_cfg))
  with pytest.raises(ValueError, match="init_lora_weights"):
    import_peft_adapter(_nnx_model(), pissa)
  with pytest.raises(ValueError, match="no LoRALinear"):
    export_peft_adapter(_nnx_model(), tmp_path / "empty")


# ---------------------------------------------------------------------------- real LLaMA
@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_llama_train_export_load_in_peft(tmp_path, variant):
  """Tiny HF LLaMA -> Flax, LoRA (paper targets) trained 3 steps with AnLR, exported, loaded by PEFT."""
  import optax
  import transformers
  from peft import PeftModel

  from anlr_jax.models.hf_io import load_hf_model

  torch.manual_seed(0)
  # one decoder layer: the export, PEFT's load and the logits do not depend on the layer count,
  # and the train step compiles in about half the time
  hf_config = tiny_llama_config(64, max_position_embeddings=64, num_hidden_layers=1)
  hf_model = transformers.LlamaForCausalLM(hf_config).eval()
  hf_model.save_pretrained(tmp_path / "base")
  model, _ = load_hf_model(tmp_path / "base")
  inject_lora(model, rank=4, alpha=8.0, dropout=0.1, use_dora=variant == "dora", rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, hf_config.vocab_size)

  optimizer = nnx.Optimizer(model, anlr_jax.anlr(1e-2, warmup_steps=1), wrt=nnx.LoRAParam)

  @nnx.jit
  def train_step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)
    return loss

  model.train()
  losses = [float(train_step(model, optimizer, tokens)) for _ in range(3)]
  assert losses[-1] < losses[0]
  model.eval()
  assert np.abs(np.asarray(model.model.layers[0].mlp.down_proj.lora_b[...])).max() > 0

  export_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
  peft_model = PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
  ids = np.asarray(jax.random.randint(jax.random.key(2), (2, 10), 0, hf_config.vocab_size))
  with torch.no_grad():
    torch_logits = peft_model(input_ids=torch.tensor(ids)).logits.numpy()
  flax_logits = np.asarray(model(jnp.asarray(ids)))
  chex.assert_trees_all_close(flax_logits, torch_logits, atol=1e-4, rtol=1e-4)
  with torch.no_grad(), peft_model.disable_adapter():
    base_logits = peft_model(input_ids=torch.tensor(ids)).logits.numpy()
  assert np.abs(torch_logits - base_logits).max() > 1e-2  # the adapter matters at this tolerance
  assert {type(m).__name__ for n, m in peft_model.named_modules() if n.endswith("q_proj")} == {
      "Linear"
  }
  n_lora = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
  assert n_lora == hf_config.num_hidden_layers * 5

  fresh, _ = load_hf_model(tmp_path / "base")
  import_peft_adapter(fresh, tmp_path / "adapter")
  chex.assert_trees_all_close(fresh(jnp.asarray(ids)), flax_logits, atol=1e-5, rtol=1e-5)
  export_peft_adapter(fresh, tmp_path / "again", base_model_name_or_path=str(tmp_path / "base"))
  assert _tensor_bytes(tmp_path / "adapter" / "adapter_model.safetensors") == _tensor_bytes(
      tmp_path / "again" / "adapter_model.safetensors"
  )


def test_read_adapter_names_what_is_wrong_with_the_directory(tmp_path):
  from anlr_jax.nn.peft_io import adapter_peft_type, read_adapter, write_adapter

  with pytest.raises(FileNotFoundError, match="adapter config not found"):
    read_adapter(tmp_path, "LORA")
  assert adapter_peft_type(tmp_path) is None
  (tmp_path / "adapter_config.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match=r"adapter_config.json: expected a JSON object .*, got list"):
    read_adapter(tmp_path, "LORA")
  (tmp_path / "adapter_config.json").write_text("{oops")
  with pytest.raises(ValueError, match="adapter_config.json:1: invalid JSON"):
    read_adapter(tmp_path, "LORA")
  tensors = {"base_model.model.x.lora_A.weight": np.ones((2, 3), np.float32)}
  write_adapter(
      tmp_path,
      tensors,
      peft_type="ADALORA",
      task_type=None,
      base_model_name_or_path=None,
      alpha=4.0,
      dropout=0.0,
      target_modules=["x"],
      init_r=2,
  )
  config = json.loads((tmp_path / "adapter_config.json").read_text())
  assert config["lora_alpha"] == 4 and isinstance(config["lora_alpha"], int)
  assert config["init_r"] == 2 and config["target_modules"] == ["x"]
  assert adapter_peft_type(tmp_path) == "ADALORA"
  with pytest.raises(ValueError, match="peft_type 'ADALORA' is not 'LORA'"):
    read_adapter(tmp_path, "LORA")
  config, read, _ = read_adapter(tmp_path, "ADALORA")
  np.testing.assert_array_equal(
      read["base_model.model.x.lora_A.weight"], tensors[next(iter(tensors))]
  )
  (tmp_path / "adapter_model.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="adapter weights not found"):
    read_adapter(tmp_path, "ADALORA")
