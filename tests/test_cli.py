"""The `anlr` CLI end to end on a tiny random HF LLaMA: train -> eval -> export -> PEFT on torch."""

import json
import os
import subprocess
import sys

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import yaml
from safetensors.numpy import load_file

from anlr_jax.app import cli
from anlr_jax.rundir import LORA_FILE
from tests.helpers.tiny_run import tiny_run_setup


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("cli")
  config = tiny_run_setup(root)
  assert cli.main(["train", "--config", str(config), "method=anlr+dora"]) == 0
  (run_dir,) = list((root / "runs").iterdir())
  return root, config, run_dir


def test_train_writes_the_run_directory(trained):
  root, _, run_dir = trained
  assert run_dir.name.startswith("anlr_dora-")
  results = json.loads((run_dir / "results.json").read_text())
  assert (
      results["method"] == "anlr+dora" and results["learning_rate"] == 5e-3 and results["seed"] == 0
  )
  acc = results["accuracy"]["winogrande"]
  assert 0.0 <= acc <= 1.0 and results["avg"] == pytest.approx(acc)
  records = [json.loads(l) for l in (run_dir / "eval_winogrande.jsonl").read_text().splitlines()]
  assert len(records) == 8 and acc == pytest.approx(np.mean([r["correct"] for r in records]))
  assert (run_dir / "accuracy.csv").read_text().startswith("Method,WinoGrande,Avg.")
  assert (run_dir / "accuracy.md").is_file() and (run_dir / "loss.png").stat().st_size > 1000
  rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in rows)
  saved = yaml.safe_load((run_dir / "config.yaml").read_text())
  assert saved["method"] == "anlr+dora" and saved["lora"]["rank"] == 4

  tensors = load_file(run_dir / LORA_FILE)
  q = "model.layers.0.self_attn.q_proj"
  assert tensors[f"{q}/lora_a"].shape == (32, 4) and tensors[f"{q}/lora_b"].shape == (4, 32)
  assert tensors[f"{q}/lora_magnitude"].shape == (32,)  # DoRA
  assert len([k for k in tensors if k.endswith("/lora_a")]) == 2 * 5  # 2 layers x paper targets
  assert np.abs(tensors[f"{q}/lora_b"]).max() > 0  # B starts at 0: training moved it


def test_eval_reproduces_the_training_accuracy(trained, tmp_path):
  _, config, run_dir = trained
  out = tmp_path / "eval"
  assert (
      cli.main(["eval", "--config", str(config), "--adapter", str(run_dir), "--out", str(out)]) == 0
  )
  ev = json.loads((out / "results.json").read_text())
  tr = json.loads((run_dir / "results.json").read_text())
  assert ev["accuracy"] == tr["accuracy"]
  gen_eval = [
      json.loads(l)["generation"] for l in (out / "eval_winogrande.jsonl").read_text().splitlines()
  ]
  gen_train = [
      json.loads(l)["generation"]
      for l in (run_dir / "eval_winogrande.jsonl").read_text().splitlines()
  ]
  assert gen_eval == gen_train


def test_export_peft_matches_torch_peft_logits(trained, tmp_path):
  from peft import PeftModel

  from anlr_jax.app.model import load_adapted_model
  from anlr_jax.app.config import load_config

  root, config, run_dir = trained
  out = tmp_path / "peft"
  assert cli.main(["export", "--run", str(run_dir), "--format", "peft", "--out", str(out)]) == 0
  adapter_config = json.loads((out / "adapter_config.json").read_text())
  assert adapter_config["use_dora"] and adapter_config["r"] == 4
  hf = transformers.LlamaForCausalLM.from_pretrained(root / "model").eval()
  peft_model = PeftModel.from_pretrained(hf, out).eval()
  ids = np.random.default_rng(1).integers(3, 200, size=(2, 12))
  with torch.no_grad():
    torch_logits = peft_model(input_ids=torch.tensor(ids)).logits.numpy()
    with peft_model.disable_adapter():
      base_logits = peft_model(input_ids=torch.tensor(ids)).logits.numpy()
  model, _, _ = load_adapted_model(load_config(config), str(run_dir))
  jax_logits = np.asarray(model(jnp.asarray(ids)))
  chex.assert_trees_all_close(jax_logits, torch_logits, atol=1e-4, rtol=1e-4)
  assert np.abs(torch_logits - base_logits).max() > 1e-4  # the trained adapter changes the output

  merged = tmp_path / "merged"
  assert (
      cli.main(["export", "--run", str(run_dir), "--format", "merged", "--out", str(merged)]) == 0
  )
  hf_merged = transformers.LlamaForCausalLM.from_pretrained(merged).eval()
  with torch.no_grad():
    merged_logits = hf_merged(input_ids=torch.tensor(ids)).logits.numpy()
  chex.assert_trees_all_close(merged_logits, torch_logits, atol=1e-4, rtol=1e-4)
  assert (merged / "tokenizer.json").is_file()


def test_generate_prints_the_adapters_answer(trained, capsys):
  _, _, run_dir = trained
  record = json.loads((run_dir / "eval_winogrande.jsonl").read_text().splitlines()[0])
  instruction = record["prompt"].split("### Instruction:\n", 1)[1].split("\n\n### Response:", 1)[0]
  capsys.readouterr()
  assert (
      cli.main(
          [
              "generate",
              "--model",
              str(trained[0] / "model"),
              "--adapter",
              str(run_dir),
              "--prompt",
              instruction,
              "--max-new-tokens",
              "6",
          ]
      )
      == 0
  )
  assert capsys.readouterr().out.strip() == record["generation"].strip()


def test_cli_errors_name_the_problem(trained, tmp_path, capsys):
  root, config, run_dir = trained
  cases = [
      (
          ["train", "--config", str(config), "lora.rnk=3"],
          "unknown key 'lora.rnk'; allowed keys in 'lora'",
      ),
      (["train", "--config", str(config), "method=qlora"], "method: 'qlora' is not allowed"),
      (["train", "--config", str(tmp_path / "none.yaml")], "config file not found"),
      (
          ["train", "--config", str(config), f"data.train={tmp_path / 'x.json'}"],
          "data.train: .*x.json does not exist",
      ),
      (["train", "--config", str(config), "model.path="], "model.path is not set"),
      (["eval", "--config", str(config), "--adapter", str(tmp_path)], "neither a run directory"),
      (
          ["export", "--run", str(tmp_path), "--format", "peft", "--out", str(tmp_path / "o")],
          "not a run directory",
      ),
  ]
  import re

  for argv, pattern in cases:
    assert cli.main(argv) == 2, argv
    assert re.search(pattern, capsys.readouterr().err), (argv, pattern)


def test_train_help_lists_every_key(capsys):
  from anlr_jax.app.config import help_text

  with pytest.raises(SystemExit) as exit_info:
    cli.main(["train", "--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for line in help_text().splitlines()[1:]:
    key = line.strip().split(" ")[0]
    assert key in out
  for key in ("lora.rank", "trainer.learning_rate", "anlr.kappa", "eval.tasks", "method"):
    assert f"  {key} (" in out


def test_analysis_subcommands_dispatch(monkeypatch):
  calls = []
  monkeypatch.setitem(cli._ANALYSIS, "analyze", lambda argv: calls.append(("analyze", argv)) or 0)
  monkeypatch.setitem(cli._ANALYSIS, "sweep", lambda argv: calls.append(("sweep", argv)) or 3)
  assert cli.main(["analyze", "--run", "x"]) == 0
  assert cli.main(["sweep", "--help"]) == 3
  assert calls == [("analyze", ["--run", "x"]), ("sweep", ["--help"])]


def test_configs_lists_the_shipped_configs_and_train_takes_a_name(capsys, tmp_path, monkeypatch):
  assert cli.main(["configs"]) == 0
  out = capsys.readouterr().out
  assert "quickstart " in out and "commonsense_llama2_7b " in out and "anlr train --config" in out
  # A shipped config by name: its paths are checked first, so a missing model is the error, and
  # the failed start creates nothing (its run_dir is relative: runs/... under the working dir).
  monkeypatch.chdir(tmp_path)
  assert cli.main(["train", "--config", "commonsense_llama2_7b"]) == 2
  assert "model.path: models/Llama-2-7b-hf does not exist" in capsys.readouterr().err
  assert list(tmp_path.iterdir()) == []
  assert cli.main(["train", "--config", "no_such_config"]) == 2
  assert "shipped configs, usable by name" in capsys.readouterr().err


def test_the_compile_cache_setting(monkeypatch, tmp_path):
  calls = []
  monkeypatch.setattr(cli.jax.config, "update", lambda *a: calls.append(a))
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  cli.use_compile_cache(None)
  assert calls == []
  cli.use_compile_cache(str(tmp_path / "cache"))
  assert ("jax_compilation_cache_dir", str(tmp_path / "cache")) in calls
  assert (tmp_path / "cache").is_dir()
  calls.clear()
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "theirs"))
  cli.use_compile_cache(str(tmp_path / "cache"))
  assert calls == []  # the environment's choice wins
  from anlr_jax.app.config import COMPILE_CACHE, RunConfig

  monkeypatch.delenv("ANLR_COMPILE_CACHE", raising=False)
  monkeypatch.delenv("ANLR_CACHE_DIR", raising=False)
  assert RunConfig().compile_cache == COMPILE_CACHE == "~/.cache/anlr_jax/xla"
  monkeypatch.setenv("ANLR_CACHE_DIR", str(tmp_path / "root"))  # beside the other downloads
  assert RunConfig().compile_cache == str(tmp_path / "root" / "xla")
  monkeypatch.setenv("ANLR_COMPILE_CACHE", str(tmp_path / "mine"))
  assert RunConfig().compile_cache == str(tmp_path / "mine")
  monkeypatch.setenv("ANLR_COMPILE_CACHE", "")
  assert RunConfig().compile_cache is None


# What `anlr configs` and `anlr train --help` imported, in a fresh process before anything else.
COMMAND_LINE_IMPORTS = """
import contextlib, io, json, sys
from anlr_jax.app import cli
with contextlib.redirect_stdout(io.StringIO()):
  assert cli.main(['configs']) == 0
  try:
    cli.main(['train', '--help'])
  except SystemExit as done:
    assert done.code == 0
heavy = ('matplotlib', 'torch', 'transformers', 'orbax', 'grain', 'tensorboardX')
print(json.dumps([m for m in heavy if m in sys.modules]))
"""

QUICK_PROGRAMS = """
import json, sys
import jax, jax.numpy as jnp
from anlr_jax.app.cli import use_compile_cache
from anlr_jax.compiles import compile_log
use_compile_cache(sys.argv[1])
with compile_log() as log:
  x = jnp.arange(6.0) * 2  # eager operations
  jax.jit(lambda v: jnp.tanh(v).sum())(x).block_until_ready()
print(json.dumps([log.compiled, log.cache_hits]))
"""


@pytest.fixture(scope="module")
def fresh_processes(tmp_path_factory):
  """stdout and stderr of two fresh processes, one after the other, each running
  COMMAND_LINE_IMPORTS first (the imports it checks are those of a fresh interpreter; it compiles
  nothing) and then QUICK_PROGRAMS on the one compile cache both share."""
  cache = tmp_path_factory.mktemp("quick") / "xla"
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  printed = []
  for _ in range(2):
    done = subprocess.run(
        [sys.executable, "-c", COMMAND_LINE_IMPORTS + QUICK_PROGRAMS, str(cache)],
        env=env,
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed.append((done.stdout, done.stderr))
  return printed


def test_a_second_process_compiles_nothing_however_quick_the_programs(fresh_processes):
  counts = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in fresh_processes]
  (compiled, _), (again, loaded) = counts
  assert compiled >= 2  # each program took far less than a second to compile
  assert again == 0 and loaded == compiled


TRAIN_STEP = "jit_counted_step-"  # the cache's name for the Trainer's jitted step


def test_a_second_process_loads_the_compiled_step_from_the_cache(trained, tmp_path):
  root, config, _ = trained
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["JAX_DEBUG_LOG_MODULES"] = "jax._src.compiler"  # logs each persistent-cache hit
  # no evaluation: the train step is the program in question (and final_loss what both must agree on)
  argv = [sys.executable, "-m", "anlr_jax", "train", "--config", str(config), "method=lora"]
  argv.append("eval.tasks={}")
  cache = tmp_path / "xla"
  for run in ("a", "b"):
    done = subprocess.run(
        [*argv, f"run_dir={tmp_path / run}", f"compile_cache={cache}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    if run == "a":
      entries = {p.name for p in cache.iterdir()}
      assert any(
          name.startswith(TRAIN_STEP) for name in entries
      ), f"no train step cached: {entries}"
  # The second run compiled no train step of its own: it loaded the first run's. (Small programs
  # whose compile time is close to the cache's 0.5 s threshold, such as the evaluation's
  # `jit__decode_step`, may be written by either run.)
  new = {p.name for p in cache.iterdir()} - entries
  assert not [name for name in new if name.startswith(TRAIN_STEP)], sorted(new)
  losses = [json.loads((tmp_path / r / "results.json").read_text())["final_loss"] for r in "ab"]
  assert losses[0] == losses[1]


def test_the_command_line_starts_without_the_libraries_it_does_not_need(fresh_processes):
  """``anlr``'s modules import matplotlib only to draw, never torch (tensorboardX and transformers'
  auto classes would), transformers only to load a tokenizer, orbax only to checkpoint and grain
  only to shuffle a run's data: each is most of a second at every start. ``anlr configs`` and
  ``anlr train --help`` need none of them."""
  for stdout, stderr in fresh_processes:
    out = stdout.strip().splitlines()[0]
    assert out == "[]", (stdout, stderr[-2000:])
