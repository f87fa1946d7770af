"""Smoke test: benchmarks/qlora_torch.py trains a tiny PEFT model with a float32 base in a worker and
reports a quantised base whose package does not import as unavailable.

torchao and bitsandbytes are not dependencies of the project: here both are stand-ins that raise on
import, put on the quantised workers' path with ``--deps``, so the test does not depend on what the
machine has installed. No threshold on any time or memory.
"""

import json
import os
import subprocess
import sys
import types

import pytest

from benchmarks import qlora_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  import torch
  import transformers

  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=96,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      tie_word_embeddings=True,
  )
  folder = tmp_path_factory.mktemp("tiny_llama")
  transformers.LlamaForCausalLM(config).save_pretrained(folder)
  return str(folder)


def _broken_deps(root) -> str:
  for package in ("torchao", "bitsandbytes"):
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text(
        f"raise ImportError('{package} stand-in for the test')\n"
    )
  return str(root)


@pytest.mark.slow  # three worker processes, each importing torch (one transformers and peft too)
def test_float32_base_trains_and_missing_packages_are_reported(tiny_model, tmp_path, capsys):
  out = tmp_path / "result.json"
  result = qlora_torch.main(
      ["--model", tiny_model, "--jax_modes", "", "--bases", "none,torchao,bnb"]
      + ["--deps", _broken_deps(tmp_path / "deps"), "--batch", "2", "--seq", "16"]
      + ["--rounds", "2", "--warmup", "2", "--threads", "1", "--out", str(out)]
  )
  printed = capsys.readouterr().out
  # the stand-ins reached the quantised workers only: the float32 worker imported peft unharmed
  assert result["unavailable"] == {
      "torch torchao": "ImportError: torchao stand-in for the test",
      "torch bnb": "ImportError: bitsandbytes stand-in for the test",
  }
  assert "torch bnb: unavailable: ImportError: bitsandbytes stand-in for the test" in printed
  assert list(result["settings"]) == ["torch none"]
  row = result["settings"]["torch none"]
  # 2 layers of q, k, v, o (64 x 64 / 32 x 64 / 32 x 64 / 64 x 64), gate, up, down (64 x 128)
  weights = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 64 * 128 * 3)
  assert row["linear_bytes"] == row["linear_float32_bytes"] == 4 * weights
  assert row["lora_params"] == 2 * 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 128) + (128 + 64))
  assert len(row["warmup_losses"]) == 2 and all(0 < x < 10 for x in row["warmup_losses"])
  assert row["lora_b_abs_sum"] > 0  # PEFT starts lora_B at zero: the steps moved it
  assert len(row["times_ms"]) == 2 and row["median_ms"] > 0
  assert row["rss_after_warmup_mib"] > 0 and row["steady_peak_rss_mib"] > 0
  assert row["checkpointing"] == "on" and row["versions"]["peft"]
  assert "torch none" in printed and "resident after warm-up" in printed
  assert json.loads(out.read_text())["unavailable"] == result["unavailable"]


def test_quantised_bytes_count_inner_tensors_and_quantisation_state():
  import torch

  codes = torch.zeros(32, dtype=torch.uint8)
  nested = types.SimpleNamespace(absmax=torch.zeros(2), code=torch.zeros(256), state2=None)
  codes.quant_state = types.SimpleNamespace(
      absmax=torch.zeros(4, dtype=torch.uint8), code=torch.zeros(16), offset=torch.zeros(()),
      state2=nested,
  )  # fmt: skip
  assert qlora_torch._tensor_bytes(codes) == 32 + 4 + 16 * 4 + 4 + 2 * 4 + 256 * 4

  class Subclass:  # a wrapper tensor: its bytes are those of its inner tensors
    data, scales = torch.zeros(8, dtype=torch.uint8), torch.zeros(3, dtype=torch.bfloat16)

    def __tensor_flatten__(self):
      return ["data", "scales"], None

  assert qlora_torch._tensor_bytes(Subclass()) == 8 + 6


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bases", "none,fp4"], "--bases 'none,fp4'"),
        (["--bases", "none,none"], "--bases 'none,none'"),
        (["--jax_modes", "nf8"], "--jax_modes 'nf8'"),
        (["--bases", "", "--jax_modes", ""], "nothing to run"),
        (["--batch", "0"], "--batch 0 must be >= 1"),
        (["--start_at_once", "0"], "--start_at_once 0 must be >= 1"),
        (["--deps", "/nonexistent/deps"], "--deps /nonexistent/deps: no such folder"),
        (["--model", "/nonexistent/m.gguf"], "--jax_modes trains"),
        (["--model", "/nonexistent/m.gguf", "--jax_modes", ""], "--model /nonexistent/m.gguf"),
    ],
)
def test_bad_arguments_are_named(argv, message):
  with pytest.raises(ValueError, match=message.replace(".", r"\.")):
    qlora_torch.main(argv)


def test_a_bad_argument_is_one_line_without_traceback():
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "qlora_torch.py"), "--bases", "fp4"],
      capture_output=True,
      text=True,
      timeout=60,
      cwd=ROOT,
  )
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      "benchmarks/qlora_torch.py: --bases 'fp4': each of ['none', 'torchao', 'bnb'] at most once"
  ]
