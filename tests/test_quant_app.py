"""``model.quantize`` through the command line: training, checkpoints, export, generate/serve/judge
flags, the dry run, every method, and the one-line errors."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import yaml
from flax import nnx

from anlr_jax.app import cli
from anlr_jax.app.config import load_config
from anlr_jax.app.assemble import build_method
from anlr_jax.app.model import load_adapted_model, load_base
from anlr_jax.methods import METHOD_NAMES, get_method
from anlr_jax.models import load_hf_model
from anlr_jax.nn.quant import QuantLinear
from tests.helpers.tiny_run import tiny_run_setup


def quantisable_setup(root):
  """The tiny CLI run with a 64-wide model (the block size divides every layer's input) of one
  decoder layer (what is checked here holds layer by layer; a layer more only compiles longer)."""
  config = tiny_run_setup(root)
  vocab = json.loads((root / "model" / "config.json").read_text())["vocab_size"]
  torch.manual_seed(0)
  hf_config = transformers.LlamaConfig(
      vocab_size=vocab,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=1,
      max_position_embeddings=256,
      pad_token_id=0,
      bos_token_id=1,
      eos_token_id=2,
  )
  transformers.LlamaForCausalLM(hf_config).save_pretrained(root / "model")
  return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("qlora")
  config = quantisable_setup(root)
  # no eval at the end: generation on this run's nf4 base and adapter is what
  # test_quantize_flags_reach_the_loader runs (``generate --adapter``)
  argv = ["train", "--config", str(config), "model.quantize=nf4", "trainer.save_every=2"]
  argv.append("eval.tasks={}")
  assert cli.main(argv) == 0
  (run_dir,) = list((root / "runs").iterdir())
  return root, config, run_dir


def all_linears_quantised(model) -> bool:
  linears = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)]
  return bool(linears) and all(isinstance(m, QuantLinear) for m in linears)


def test_a_qlora_run_trains_and_its_checkpoints_hold_no_base(trained):
  root, _, run_dir = trained
  saved = yaml.safe_load((run_dir / "config.yaml").read_text())
  assert saved["model"]["quantize"] == "nf4"
  rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 4 and all(np.isfinite(r["loss"]) for r in rows)
  checkpoints = [p for p in root.rglob("*") if p.is_dir() and p.name.isdigit()]
  assert checkpoints  # trainer.save_every=2
  for step in checkpoints:
    assert not (step / "frozen").exists(), step
    names = json.loads((step / "state" / "_METADATA").read_text())["tree_metadata"]
    assert any("lora_a" in n for n in names)
    assert not any(part in n for n in names for part in ("codes", "scales", "kernel")), step


def test_exports_of_a_qlora_run(trained, tmp_path):
  from peft import PeftModel

  root, config, run_dir = trained
  model, _, _ = load_adapted_model(load_config(config), str(run_dir))
  assert all_linears_quantised(model)  # the run's base is quantised again
  ids = jnp.asarray(np.random.default_rng(1).integers(3, 200, size=(2, 12)))
  qlora_logits = model(ids)

  merged = tmp_path / "merged"
  assert (
      cli.main(["export", "--run", str(run_dir), "--format", "merged", "--out", str(merged)]) == 0
  )
  merged_model, _ = load_hf_model(merged)  # dequantised + merged, in float
  rel = jnp.linalg.norm(merged_model(ids) - qlora_logits) / jnp.linalg.norm(qlora_logits)
  assert rel < 1e-5

  peft_dir = tmp_path / "peft"
  assert (
      cli.main(["export", "--run", str(run_dir), "--format", "peft", "--out", str(peft_dir)]) == 0
  )
  assert not any("base_layer" in k or k.endswith(".codes") for k in _keys(peft_dir))
  hf = transformers.LlamaForCausalLM.from_pretrained(root / "model").eval()
  peft_model = PeftModel.from_pretrained(hf, peft_dir).eval()  # on the full-precision base
  with torch.no_grad():
    torch_logits = peft_model(input_ids=torch.tensor(np.asarray(ids))).logits.numpy()
  float_config = load_config(config, ["model.quantize=none"])
  ours, _, _ = load_adapted_model(float_config, str(peft_dir))
  np.testing.assert_allclose(np.asarray(ours(ids)), torch_logits, atol=1e-4, rtol=1e-4)


def _keys(peft_dir):
  from safetensors.numpy import load_file

  return list(load_file(peft_dir / "adapter_model.safetensors"))


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_every_method_runs_on_a_quantised_base(trained, method):
  _, config, _ = trained
  run_config = load_config(config, [f"method={method}", "model.quantize=int8"])
  model, _, _ = load_base(run_config)
  # PiSSA / MiLoRA: the base is read in float, the init taken from it, then quantised
  assert all_linears_quantised(model) == (get_method(method).init == "default")
  build_method(run_config, model=model)
  assert all_linears_quantised(model)
  grads = nnx.grad(
      lambda m: jnp.mean(m(jnp.ones((1, 8), jnp.int32)) ** 2),
      argnums=nnx.DiffState(0, nnx.LoRAParam),
  )(model)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_dry_run_gives_bytes_per_base_parameter(trained, capsys):
  _, config, _ = trained
  base = ["train", "--config", str(config), "--dry_run", "--devices", "1"]
  assert cli.main(base) == 0
  plain = capsys.readouterr().out
  assert cli.main(base + ["model.quantize=nf4"]) == 0
  quantised = capsys.readouterr().out
  per_param = lambda out: float(re.search(r"([\d.]+) bytes per base parameter", out)[1])  # noqa
  assert per_param(plain) == pytest.approx(4.0)
  assert "linear layers and embedding table nf4" in quantised
  assert per_param(quantised) < 1.0  # float32 norms and biases only


def test_quantize_flags_reach_the_loader(trained, monkeypatch, capsys):
  import anlr_jax.app.model as app_model
  import anlr_jax.app.serve as serve

  root, config, run_dir = trained
  seen = []
  real = app_model.load_hf_model
  monkeypatch.setattr(
      app_model, "load_hf_model", lambda *a, **k: seen.append(k["quantize"]) or real(*a, **k)
  )
  argv = ["generate", "--model", str(root / "model"), "--prompt", "hi", "--max-new-tokens", "2"]
  assert cli.main(argv + ["--quantize", "int8"]) == 0
  assert cli.main(argv + ["--adapter", str(run_dir)]) == 0  # the run's own nf4
  # an explicit none: the adapter of the nf4 run on the float base
  assert cli.main(argv + ["--adapter", str(run_dir), "--quantize", "none"]) == 0
  assert seen == ["int8", "nf4", "none"]
  served = []
  monkeypatch.setattr(serve, "serve_main", lambda config, *a, **k: served.append((config, k)))
  assert cli.main(["serve", "--config", str(config), "--quantize", "nf4"]) == 0
  assert served[0][0].model.quantize == "nf4"
  # serve --quantize none under the nf4 run's adapter: the float base
  argv = ["serve", "--config", str(config), "--adapter", str(run_dir), "--quantize", "none"]
  assert cli.main(argv) == 0 and served[1][1]["quantize"] == "none"
  seen.clear()
  serve.load_service(served[1][0], str(run_dir), quantize="none").close()
  assert seen == ["none"]
  judge = load_config(config, ["eval.judge.quantize=int8"]).eval.judge
  assert judge.quantize == "int8"


def test_bad_quantize_input_is_one_line(trained, capsys):
  _, config, _ = trained
  cases = {
      "model.quantize=nf5": "model.quantize",
      "model.quantize=nf4 trainer.devices=2 trainer.mesh_fsdp=2": "would split its 64-weight",
  }
  for overrides, message in cases.items():
    argv = ["train", "--config", str(config), *overrides.split()]
    assert cli.main(argv) == 2, overrides
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
