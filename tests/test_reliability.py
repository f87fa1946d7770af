"""The unhappy path: checkpoints that belong to one run, finished runs, corrupt files, non-finite
steps, signals, one writer per directory, metrics as a function of the step, and configs that say
what they do. Each test names the fault of docs/reliability.md that it shows."""

import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

import anlr_jax
from anlr_jax.app import cli
from anlr_jax.rundir import LORA_FILE, RESULTS_FILE
from anlr_jax.train.checkpoint import CHECKSUM_FILE, TrainCheckpointer, seal_directory
from anlr_jax.train.lock import DirectoryLock, DirectoryLockedError
from anlr_jax.train.metrics import MetricsWriter, read_metrics
from anlr_jax.train.trainer import (
    CheckpointMismatchError,
    NonFiniteError,
    Trainer,
    TrainerConfig,
)
from tests.helpers.toy_lm import ToyBatches, make_toy_model, make_toy_trainer
from tests.helpers.tiny_run import tiny_run_config as _tiny_run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_run_config(root: pathlib.Path, **changes) -> pathlib.Path:
  """The tiny CLI setup of every run here, with a 1-layer model: no test here is about the layers'
  count, and the programs of 1 compile faster (one model for all: compiled programs are reused)."""
  return _tiny_run_config(root, layers=1, **changes)


@pytest.fixture(autouse=True)
def _library_warnings_reach_caplog(monkeypatch):
  # the CLI sends the library's warnings to stderr and stops their propagation; tests read them
  monkeypatch.setattr(logging.getLogger("anlr_jax"), "propagate", True)


def _err(capsys) -> str:
  return capsys.readouterr().err


# ------------------------------------------------------------------ 1. checkpoints belong to a run
def test_compare_mode_gives_each_method_its_own_checkpoints(tmp_path):
  changes = {"trainer.ckpt_dir": str(tmp_path / "ck"), "eval.tasks": {}}  # training is the point
  config = tiny_run_config(tmp_path, compare=["lora", "anlr"], **changes)
  assert cli.main(["train", "--config", str(config)]) == 0
  assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["anlr", "lora"]
  lora = load_file(tmp_path / "run" / "lora" / LORA_FILE)
  anlr = load_file(tmp_path / "run" / "anlr" / LORA_FILE)
  assert any(not np.array_equal(lora[k], anlr[k]) for k in lora)  # anlr did not restore lora's


def test_method_and_seed_expand_in_path_keys(tmp_path):
  changes = {"trainer.ckpt_dir": str(tmp_path / "ck-{method}-{seed}"), "eval.tasks": {}}
  config = tiny_run_config(tmp_path, **changes)
  assert cli.main(["train", "--config", str(config), "seed=3", "method=lora"]) == 0
  assert (tmp_path / "ck-lora-3").is_dir() and not (tmp_path / "ck-{method}-{seed}").exists()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  root = tmp_path_factory.mktemp("finished")
  config = tiny_run_config(root, method="anlr")
  assert cli.main(["train", "--config", str(config)]) == 0
  return root, config


def test_resume_with_other_settings_names_each_key(finished, tmp_path, capsys):
  root, config = finished
  ckpt = root / "run" / "checkpoints"
  for override, pattern in [
      ("method=lora", r"method: 'anlr' -> 'lora'"),
      ("trainer.learning_rate=0.001", r"trainer.learning_rate: 0.005 -> 0.001"),
      ("seed=1", r"seed: 0 -> 1"),
      ("lora.rank=8", r"lora.rank: 4 -> 8"),
      ("lora.targets=[q_proj]", r"lora.targets: \[.*\] -> \['q_proj'\]"),
  ]:
    argv = [
        "train",
        "--config",
        str(config),
        f"run_dir={tmp_path / override}",
        f"trainer.ckpt_dir={ckpt}",
        override,
    ]
    assert cli.main(argv) == 2, override
    err = _err(capsys)
    assert re.search(pattern, err) and "belongs to a run with other settings" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def _files(folder: pathlib.Path) -> dict[str, bytes]:
  """Every file under ``folder`` with its bytes: what a refused command must leave as it was."""
  return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _copy_run(finished, tmp_path) -> pathlib.Path:
  """A copy of the finished run directory (its checkpoints inside it) to change freely."""
  run = tmp_path / "run"
  shutil.copytree(finished[0] / "run", run)
  return run


@pytest.mark.parametrize(
    "state, override, refused",
    [
        ("complete", "lora.rank=8", r"run directory .* \(.*lora.rank: 4 -> 8"),
        ("trained", "trainer.learning_rate=0.001", r"lora_final.safetensors .* \(.*0.005 -> 0.001"),
    ],
)
def test_a_finished_run_with_other_settings_is_refused_and_left_alone(
    finished, tmp_path, capsys, state, override, refused
):
  """Complete, or trained with its evaluation still to do (no results.json): re-run with another
  setting, the run directory is refused in one line naming the key, and no file of it changes."""
  _, config = finished
  run = _copy_run(finished, tmp_path)
  if state == "trained":
    (run / RESULTS_FILE).unlink()
  before = _files(run)
  assert cli.main(["train", "--config", str(config), f"run_dir={run}", override]) == 2
  out, err = capsys.readouterr()
  assert "complete already" not in out and "evaluating" not in out
  assert re.search(refused, err) and "belongs to a run with other settings" in err, err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1
  assert _files(run) == before  # config.yaml included: still the finished run's
  assert cli.main(["train", "--config", str(config), f"run_dir={run}"]) == 0
  done = {"complete": "complete already", "trained": "trained already"}[state]
  assert done in capsys.readouterr().out  # the same settings: its results, or their evaluation


def test_resume_allow_permits_a_longer_schedule(finished, tmp_path, capsys):
  root, config = finished
  argv = [
      "train",
      "--config",
      str(config),
      f"run_dir={tmp_path / 'longer'}",
      f"trainer.ckpt_dir={root / 'run' / 'checkpoints'}",
      "trainer.steps=6",
  ]
  assert cli.main(argv) == 2 and "trainer.steps: 4 -> 6" in _err(capsys)
  assert cli.main(argv + ["trainer.resume_allow=[trainer.steps]"]) == 0
  assert "resumed at update 4" in capsys.readouterr().out
  rows = read_metrics(str(tmp_path / "longer"))
  assert [r["step"] for r in rows] == [5, 6]


def test_trainer_refuses_a_checkpoint_of_another_structure(tmp_path):
  def trainer(rank):
    model = make_toy_model(rank=rank)
    return make_toy_trainer(
        optax.adamw(1e-2), model=model, checkpoint_dir=tmp_path, steps=2, one_device=True
    )

  first = trainer(4)
  first.save()  # of the initial state: the structure is the point, no update needs compiling
  first.close()
  with pytest.raises(
      CheckpointMismatchError,
      match=r"another structure .*\(2, 16, 4\) float32 -> \(2, 16, 8\) float32",
  ):
    trainer(8)


# --------------------------------------------------------------- 2. a finished run stays finished
def test_rerunning_a_finished_run_says_it_is_complete(finished, capsys):
  root, config = finished
  before = (root / "run" / RESULTS_FILE).read_text()
  assert cli.main(["train", "--config", str(config)]) == 0
  assert "complete already" in capsys.readouterr().out
  assert (root / "run" / RESULTS_FILE).read_text() == before


def test_a_run_killed_after_its_final_checkpoint_completes(finished, tmp_path, capsys):
  _, config = finished
  run = _copy_run(finished, tmp_path)
  for later in (run / "checkpoints").iterdir():  # other tests resume its checkpoints to 6
    if later.name.isdigit() and int(later.name) > 4:
      shutil.rmtree(later)
  expected = json.loads((run / RESULTS_FILE).read_text())
  for name in (RESULTS_FILE, LORA_FILE, "accuracy.csv", "eval_winogrande.jsonl"):
    (run / name).unlink()  # as if killed right after the final checkpoint
  assert cli.main(["train", "--config", str(config), f"run_dir={run}"]) == 0
  again = json.loads((run / RESULTS_FILE).read_text())
  assert again["accuracy"] == expected["accuracy"]
  assert again["final_loss"] == pytest.approx(expected["final_loss"])  # from all 4 rows
  assert (run / LORA_FILE).is_file()


def test_a_finished_checkpoint_resumed_in_a_new_run_directory_completes(finished, tmp_path, capsys):
  """The final checkpoint of a run taken up by a new run directory (no update left to train, no
  loss row there): the adapter is written and evaluated, ``final_loss`` is None, no loss plot."""
  root, config = finished
  run, ckpt = tmp_path / "new", tmp_path / "checkpoints"
  shutil.copytree(root / "run" / "checkpoints" / "4", ckpt / "4")  # other tests add 5 and 6
  argv = ["train", "--config", str(config), f"run_dir={run}", f"trainer.ckpt_dir={ckpt}"]
  assert cli.main(argv) == 0, capsys.readouterr().err
  out = capsys.readouterr().out
  assert "resumed at update 4" in out and "final loss n/a" in out
  results = json.loads((run / RESULTS_FILE).read_text())
  expected = json.loads((root / "run" / RESULTS_FILE).read_text())
  assert results["accuracy"] == expected["accuracy"] and results["final_loss"] is None
  assert (run / LORA_FILE).is_file() and not (run / "loss.png").exists()


# ----------------------------------------------------------------------------- 3. integrity
def _ckpt_trainer(ckpt, steps=4, **kw):
  cfg = TrainerConfig(
      steps=steps,
      global_batch=8,
      compute_dtype="float32",
      progress=False,
      save_every=2,
      keep=2,
      devices=1,  # what is on disk is the point: one device compiles fastest
      **kw,
  )
  return Trainer(make_toy_model(), ToyBatches(), cfg, optax.adamw(1e-2), checkpoint_dir=str(ckpt))


def _largest_file(folder: pathlib.Path) -> pathlib.Path:
  files = [p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE]
  return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["flip", "truncate", "truncate-resealed"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage, caplog):
  """Damaged after its seal (flipped bytes, a file cut short), or before it (a file cut short and
  then sealed as it was, so that only orbax's read can tell), a newest checkpoint is named in one
  line and the one before it restored."""
  first = _ckpt_trainer(tmp_path)
  first.run()
  first.close()
  # the data files that orbax reads (the per-process files merged into state/d at commit are not)
  victim = _largest_file(tmp_path / "4" / ("state/d" if damage.endswith("resealed") else ""))
  data = bytearray(victim.read_bytes())
  if damage == "flip":
    data[len(data) // 2] ^= 0xFF
  else:
    data = data[: len(data) // 2]
  victim.write_bytes(bytes(data))
  assert "does not match its checksum" in TrainCheckpointer(tmp_path).verify(4)
  if damage.endswith("resealed"):
    seal_directory(str(tmp_path / "4"))
    assert TrainCheckpointer(tmp_path).verify(4) is None
  with caplog.at_level(logging.WARNING, logger="anlr_jax.train"):
    second = _ckpt_trainer(tmp_path)
  assert second.step == 2
  (message,) = [r.getMessage() for r in caplog.records if "checkpoint 4" in r.getMessage()]
  assert message.endswith("restored checkpoint 2 instead")
  assert ("cannot be read" if damage.endswith("resealed") else "is corrupt") in message


def test_a_sealed_checkpoint_with_nan_values_is_not_restored(tmp_path, caplog):
  """NaN values that were NaN when saved (the seal agrees with the files): the restored values
  are checked, and the checkpoint is skipped in one warning."""
  first = _ckpt_trainer(tmp_path, steps=2)
  first.run()
  first.close()
  nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), first.state.lora)
  first.replace_state(first.state._replace(lora=nan, step=jnp.asarray(3, jnp.int32)))
  checkpointer = TrainCheckpointer(tmp_path, keep=3)
  meta = {"identity": first.identity, "config": {"lora_layout": first.config.lora_layout}}
  checkpointer.save(3, first.state, meta, force=True)
  checkpointer.wait()
  assert checkpointer.verify(3) is None
  with caplog.at_level(logging.WARNING, logger="anlr_jax.train"):
    second = _ckpt_trainer(tmp_path, steps=2)
  assert second.step == 2
  assert any("non-finite values" in r.getMessage() for r in caplog.records)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(second.state.lora))


def test_a_truncated_adapter_file_is_one_clear_line(finished, tmp_path, capsys):
  root, config = finished
  run = tmp_path / "run"
  run.mkdir()
  for name in ("config.yaml", LORA_FILE):
    (run / name).write_bytes((root / "run" / name).read_bytes())
  data = (run / LORA_FILE).read_bytes()
  (run / LORA_FILE).write_bytes(data[: len(data) // 2])
  for argv in (
      ["export", "--run", str(run), "--format", "peft", "--out", str(tmp_path / "out")],
      ["eval", "--config", str(config), "--adapter", str(run)],
  ):
    assert cli.main(argv) == 2
    err = _err(capsys)
    assert "not a readable safetensors file (truncated or corrupt?)" in err, err
    assert len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------- 4. non-finite and divergence
def test_token_ids_outside_the_vocab_fail_at_data_load(tmp_path, capsys):
  import torch
  import transformers

  config = tiny_run_config(tmp_path)
  hf = transformers.AutoConfig.from_pretrained(tmp_path / "model")
  hf.vocab_size = 40  # smaller than the tokenizer's ids
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "small")
  argv = ["train", "--config", str(config), f"model.path={tmp_path / 'small'}"]
  assert cli.main(argv + [f"model.tokenizer={tmp_path / 'model'}"]) == 2
  err = _err(capsys)
  assert "outside the model's vocabulary of 40" in err and "does not belong to the model" in err
  assert not (tmp_path / "run" / LORA_FILE).exists()


class _PoisonedBatches(ToyBatches):
  """ToyBatches whose batches from ``start`` on make the loss non-finite (an inf loss weight)."""

  def __init__(self, start, **kw):
    super().__init__(**kw)
    self.start = start

  def get_batch(self, step, **kw):
    batch = super().get_batch(step, **kw)
    if step >= self.start:
      batch = dict(batch, loss_mask=np.full_like(batch["loss_mask"], np.inf))
    return batch


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path):
  cfg = TrainerConfig(
      steps=10,
      global_batch=8,
      compute_dtype="float32",
      progress=False,
      max_nonfinite=3,
      devices=1,  # the step guard is the point: one device compiles it fastest
  )
  tx = anlr_jax.anlr(1e-2, warmup_steps=1)
  trainer = Trainer(make_toy_model(), _PoisonedBatches(2), cfg, tx, log_dir=str(tmp_path))
  trainer.train_step()
  trainer.train_step()
  good = jax.device_get(trainer.state)
  with pytest.raises(NonFiniteError, match=r"3 consecutive updates \(steps 3-5"):
    trainer.run()
  after = jax.device_get(trainer.state)
  for a, b in zip(
      jax.tree.leaves((good.lora, good.opt_state)), jax.tree.leaves((after.lora, after.opt_state))
  ):
    np.testing.assert_array_equal(a, b)  # skipped: params and optimizer state untouched
  rows = read_metrics(str(tmp_path))
  assert [r["skipped_total"] for r in rows] == [1.0, 2.0, 3.0]


def _nan_gradient_entry(lora):
  """A loss term whose value is 0 and whose gradient is NaN in one entry of one adapter factor:
  ``d/dx sqrt(x - x') = 1 / (2 sqrt(0))`` times 0."""
  x = jax.tree.leaves(lora)[0].reshape(-1)[0]
  return 0.0 * jnp.sqrt(x - jax.lax.stop_gradient(x))


def test_a_non_finite_gradient_with_a_finite_loss_is_skipped(tmp_path):
  cfg = TrainerConfig(
      steps=10,
      global_batch=8,
      compute_dtype="float32",
      progress=False,
      max_nonfinite=3,
      devices=1,  # the step guard is the point: one device compiles it fastest
  )
  tx = anlr_jax.anlr(1e-2, warmup_steps=1)
  trainer = Trainer(
      make_toy_model(),
      ToyBatches(),
      cfg,
      tx,
      log_dir=str(tmp_path),
      loss_regularizer=_nan_gradient_entry,
  )
  before = jax.device_get(trainer.state)
  with pytest.raises(NonFiniteError, match=r"3 consecutive updates \(steps 1-3"):
    trainer.run()
  after = jax.device_get(trainer.state)
  for a, b in zip(
      jax.tree.leaves((before.lora, before.opt_state)),
      jax.tree.leaves((after.lora, after.opt_state)),
  ):
    np.testing.assert_array_equal(a, b)  # skipped: params and optimizer state untouched
  rows = read_metrics(str(tmp_path))
  assert [r["skipped_total"] for r in rows] == [1.0, 2.0, 3.0]
  assert all(np.isfinite(r["loss"]) and r["regularizer"] == 0.0 for r in rows)  # finite loss
  assert not any(np.isfinite(r["grad_norm"]) for r in rows)  # the gradient norm decided


def test_a_stuck_loss_is_warned_about(tmp_path, caplog):
  class Silent(ToyBatches):

    def get_batch(self, step, **kw):
      batch = super().get_batch(step, **kw)
      return dict(batch, loss_mask=np.zeros_like(batch["loss_mask"]))  # loss 0, gradient 0

  cfg = TrainerConfig(steps=6, global_batch=8, compute_dtype="float32", progress=False, devices=1)
  with caplog.at_level(logging.WARNING, logger="anlr_jax.train"):
    Trainer(make_toy_model(), Silent(), cfg, optax.adamw(1e-2)).run()
  (message,) = [r.getMessage() for r in caplog.records if "stopped moving" in r.getMessage()]
  assert "gradient norm is 0 for 3 logged steps (up to step 3" in message


def test_nan_adapters_are_never_written(tmp_path):
  from flax import nnx

  from anlr_jax.models import LlamaForCausalLM, ModelConfig
  from anlr_jax.nn import inject_lora
  from anlr_jax.app.model import save_lora_params

  model = LlamaForCausalLM(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
  inject_lora(model, target_modules=("q_proj",), rank=2, alpha=4, rngs=nnx.Rngs(1))
  layer = model.model.layers[0].self_attn.q_proj
  layer.lora_b[...] = jnp.full_like(layer.lora_b[...], jnp.nan)
  with pytest.raises(ValueError, match="NaN/Inf"):
    save_lora_params(model, tmp_path / LORA_FILE)
  assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------- 5. signals
def _cli_process(argv, cwd):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.Popen(
      [sys.executable, "-m", "anlr_jax", *argv],
      cwd=cwd,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )


def _wait_for_rows(run: pathlib.Path, n: int, proc, timeout=180):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if len(read_metrics(str(run))) >= n:
      return
    assert proc.poll() is None, proc.communicate()
    time.sleep(0.05)
  raise AssertionError("no metrics rows appeared")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_a_checkpoint_and_the_run_resumes(tmp_path, capsys, signum):
  config = tiny_run_config(
      tmp_path,
      method="lora",
      **{"trainer.steps": 400, "eval.tasks": {}, "data.max_length": 128},
  )
  proc = _cli_process(["train", "--config", str(config)], tmp_path)
  _wait_for_rows(tmp_path / "run", 3, proc)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signum, err
  assert "Traceback" not in err
  (line,) = [l for l in err.splitlines() if "checkpoint saved" in l]
  step = int(re.search(r"at update (\d+) of 400", line).group(1))
  assert "run the same command again to resume" in line
  assert TrainCheckpointer(tmp_path / "run" / "checkpoints").all_steps() == [step]
  rows = read_metrics(str(tmp_path / "run"))
  assert rows[-1]["step"] == step
  if signum == signal.SIGINT:
    return  # the resume below is the same for both signals: shown once

  # resumed to a slightly longer end: one row per step, none repeated (resumed in this process:
  # what the signalled one left on disk is what counts)
  argv = ["train", "--config", str(config), f"trainer.steps={step + 3}"]
  assert cli.main(argv + ["trainer.resume_allow=[trainer.steps]"]) == 0
  assert f"resumed at update {step}" in capsys.readouterr().out
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(l)["step"] for l in lines] == list(range(1, step + 4))
  csv_steps = [l.split(",")[0] for l in (tmp_path / "run" / "metrics.csv").read_text().splitlines()]
  assert csv_steps[1:] == [str(s) for s in range(1, step + 4)]


# ---------------------------------------------------------------------- 6. one writer per run
def test_a_second_writer_fails_fast_and_a_stale_lock_is_taken_over(tmp_path, caplog):
  code = (
      "import sys, time; from anlr_jax.train.lock import DirectoryLock;"
      f"DirectoryLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)"
  )
  holder = subprocess.Popen(
      [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(
        DirectoryLockedError, match=rf"in use by another anlr process \(pid {holder.pid}"
    ):
      DirectoryLock(tmp_path).acquire()
  finally:
    holder.kill()  # SIGKILL: the lock file stays, naming a dead pid
    holder.wait()
  with caplog.at_level(logging.WARNING, logger="anlr_jax.train"):
    lock = DirectoryLock(tmp_path).acquire()
  assert any(f"left by pid {holder.pid}" in r.getMessage() for r in caplog.records)
  lock.release()


HOLDER = r"""
import sys
from anlr_jax.train.lock import DirectoryLock

locks = {}
for line in sys.stdin:  # "acquire <dir>" / "release <dir>", one answer line each
  verb, folder = line.rstrip("\n").split(" ", 1)
  if verb == "acquire":
    locks[folder] = DirectoryLock(folder).acquire()
    print("held", flush=True)
  else:
    locks.pop(folder).release()
    print("released", flush=True)
"""


@pytest.fixture(scope="module")
def lock_holder():
  """Another process that takes and gives back directory locks on request (``ask(verb, dir)``):
  one start of Python and the library for all the tests that need a lock held elsewhere."""
  holder = subprocess.Popen(
      [sys.executable, "-c", HOLDER],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      cwd=REPO,
  )

  def ask(verb: str, folder: pathlib.Path) -> str:
    holder.stdin.write(f"{verb} {folder}\n")
    holder.stdin.flush()
    return holder.stdout.readline().strip()

  try:
    yield ask
  finally:
    holder.kill()
    holder.wait()


@pytest.mark.parametrize("state", ["new", "trained", "complete", "compare"])
def test_two_trainings_on_one_run_dir(finished, tmp_path, state, lock_holder):
  """A second ``anlr train`` on a run directory in use fails at once and writes nothing, whatever
  the directory holds: nothing yet, a trained adapter to evaluate, or a complete run; and a
  comparison (``compare``: one sub-directory per method) held by another process as a whole."""
  _, config = finished
  run = tmp_path / "run"
  if state in ("new", "compare"):
    with DirectoryLock(run, what="run directory"):
      pass  # re-entrant and released: the lock file names nobody afterwards
  else:
    _copy_run(finished, tmp_path)
    if state == "trained":
      (run / RESULTS_FILE).unlink()  # trained, not evaluated yet
  assert lock_holder("acquire", run) == "held"
  try:
    before = _files(run)
    argv = ["train", "--config", str(config), f"run_dir={run}"]
    if state == "compare":
      argv.append("compare=[lora,anlr]")
    assert cli.main(argv) == 2
    assert _files(run) == before  # no config.yaml, no metrics, no results
  finally:
    assert lock_holder("release", run) == "released"


# --------------------------------------------------------------- 7. metrics are a function of step
def test_a_resumed_writer_keeps_one_row_per_step(tmp_path):
  writer = MetricsWriter(str(tmp_path), total_steps=6, progress=False, is_writer=True)
  metrics = {"loss": 1.0, "tokens": 8.0, "skipped": 0.0}
  for step in range(1, 6):
    writer.record(step, dict(metrics, loss=float(step)))
    writer.write_diagnostics(step, {"x": np.zeros(2)})
  writer.close()
  resumed = MetricsWriter(
      str(tmp_path), total_steps=6, progress=False, is_writer=True, start_step=3
  )
  assert [r["step"] for r in resumed.rows] == [1, 2, 3]
  resumed.record(4, dict(metrics, loss=40.0))
  resumed.close()
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
  assert [l.split(",")[0] for l in (tmp_path / "metrics.csv").read_text().splitlines()] == [
      "step",
      "1",
      "2",
      "3",
      "4",
  ]
  assert sorted(os.listdir(tmp_path / "diagnostics")) == [f"step_{s:08d}.npz" for s in (1, 2, 3)]


def _tensorboard_scalars(event_dir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  """The scalars of a TensorBoard event file, read record by record (length, crc, event, crc)."""
  from tensorboardX.proto import event_pb2

  (path,) = event_dir.glob("events.out.tfevents.*")
  data, at, scalars = path.read_bytes(), 0, {}
  while at < len(data):
    length = int.from_bytes(data[at : at + 8], "little")
    event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
    at += 12 + length + 4
    for value in event.summary.value:
      scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_the_metrics_writer_writes_tensorboard_scalars_without_importing_torch(tmp_path):
  """tensorboardX's writer module imports torch when torch is installed (a second of every start);
  the writer imports it with torch hidden, and the events still hold every scalar."""
  code = (
      "import sys; from anlr_jax.train.metrics import MetricsWriter\n"
      f"w = MetricsWriter({str(tmp_path)!r}, total_steps=2, progress=False, is_writer=True)\n"
      "w.record(1, {'loss': 2.5, 'tokens': 8.0, 'skipped': 0.0})\n"
      "w.record(2, {'loss': 1.25, 'tokens': 8.0, 'skipped': 0.0})\n"
      "w.close(); print('torch' in sys.modules)"
  )
  repo = pathlib.Path(__file__).resolve().parents[1]
  out = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=120
  )
  assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
  scalars = _tensorboard_scalars(tmp_path / "tensorboard")
  assert scalars["loss"] == [(1, 2.5), (2, 1.25)]
  import torch  # noqa: F401  installed: the test would pass vacuously without it


def test_without_tensorboardx_the_metrics_writer_warns_once_and_writes_the_jsonl(
    tmp_path, monkeypatch, caplog
):
  """A missing logging extra is no reason to lose a training run: one warning naming the package
  and the folder left empty, and the metric rows still written."""
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` raises
  with caplog.at_level("WARNING", logger="anlr_jax"):
    w = MetricsWriter(str(tmp_path), total_steps=2, progress=False, is_writer=True)
    w.record(1, {"loss": 2.5, "tokens": 8.0, "skipped": 0.0})
    w.record(2, {"loss": 1.25, "tokens": 8.0, "skipped": 0.0})
    w.close()
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warnings) == 1 and "tensorboardX is not installed" in warnings[0], warnings
  assert str(tmp_path / "tensorboard") in warnings[0]
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["loss"]) for r in rows] == [(1, 2.5), (2, 1.25)]
  assert not (tmp_path / "tensorboard").exists()


# ---------------------------------------------------------------- 8. say what the config does
def test_anlr_warmup_beyond_the_run_is_an_error(tmp_path, capsys):
  config = tiny_run_config(tmp_path, method="anlr", **{"anlr.warmup_steps": 100})
  assert cli.main(["train", "--config", str(config)]) == 2
  err = _err(capsys)
  assert "anlr.warmup_steps=100 is not below the run's 4 updates" in err
  assert "would train exactly like lora" in err


def test_a_comparison_whose_second_method_cannot_run_stops_before_the_first_trains(
    tmp_path, capsys
):
  """compare [lora, anlr] with an AnLR warmup beyond the run: one line before LoRA trains (it used
  to train and score LoRA first, then stop at AnLR), and no run directory."""
  config = tiny_run_config(tmp_path, compare=["lora", "anlr"], **{"anlr.warmup_steps": 100})
  capsys.readouterr()  # the setup's own output
  assert cli.main(["train", "--config", str(config)]) == 2
  err = _err(capsys).strip().splitlines()
  assert len(err) == 1 and "anlr.warmup_steps=100 is not below the run's 4 updates" in err[0]
  assert not (tmp_path / "run").exists()


def test_the_data_report_counts_dropped_records_and_clipped_warmup(tmp_path, capsys):
  config = tiny_run_config(
      tmp_path, method="lora", **{"trainer.lr_warmup_steps": 10, "eval.tasks": {}}
  )
  with open(tmp_path / "train.jsonl", "a") as f:
    for i in range(5):  # responses beyond max_length: dropped
      record = {"instruction": "word " * 200, "input": "", "output": "x", "answer": "option1"}
      f.write(json.dumps(record) + "\n")
  assert cli.main(["train", "--config", str(config)]) == 0
  out = capsys.readouterr().out
  assert "53 records in" in out and "48 used" in out and "5 dropped (no response token" in out
  assert "trainer.lr_warmup_steps=10 is more than the run's 4 updates" in out


@pytest.mark.parametrize("key", ["model.path", "model.tokenizer", "data.train", "eval.tasks.boolq"])
def test_a_start_with_a_missing_input_creates_nothing(tmp_path, capsys, key):
  config = tiny_run_config(tmp_path, compare=["lora", "anlr"])
  assert cli.main(["train", "--config", str(config), f"{key}={tmp_path / 'missing'}"]) == 2
  err = _err(capsys)
  assert f"{key}: {tmp_path / 'missing'} does not exist" in err, err
  assert not (tmp_path / "run").exists()  # no run directory, config.yaml or lock file


@pytest.mark.parametrize(
    "train, message",
    [
        (
            "benchmark://commonsense/heldout",
            "data.train: benchmark://commonsense/heldout: a training",
        ),
        ("benchmark://gsm8k/tune", "data.train: benchmark://gsm8k/tune: only the multiple-choice"),
    ],
)
def test_a_training_uri_that_is_not_a_tuning_split_creates_nothing(
    tmp_path, capsys, train, message
):
  config = tiny_run_config(tmp_path, **{"data.train": train})
  capsys.readouterr()  # the setup's output
  assert cli.main(["train", "--config", str(config)]) == 2
  err = _err(capsys).strip()
  assert err.startswith(f"anlr train: error: {message}") and "\n" not in err, err
  assert not (tmp_path / "run").exists()


def test_a_training_uri_asks_for_the_completion_format(tmp_path, capsys):
  config = tiny_run_config(
      tmp_path, **{"data.train": "benchmark://boolq/tune", "data.format": "alpaca"}
  )
  assert cli.main(["train", "--config", str(config)]) == 2
  assert "data.format: benchmark://boolq/tune is a set of prompt/completion records" in _err(capsys)
  assert not (tmp_path / "run").exists()


def test_eval_checks_every_task_file_before_scoring(finished, tmp_path, capsys):
  root, config = finished
  out = tmp_path / "eval"
  argv = [
      "eval",
      "--config",
      str(config),
      "--adapter",
      str(root / "run"),
      "--out",
      str(out),
      f"eval.tasks.boolq={tmp_path / 'missing.json'}",
  ]
  assert cli.main(argv) == 2
  assert "eval.tasks.boolq" in _err(capsys)
  assert not out.exists()


# -------------------------------------------------------------------------- 9. merged export
def test_merged_export_keeps_the_base_config_and_generation_config(finished, tmp_path):
  root, _ = finished
  base = root / "model"
  hf = json.loads((base / "config.json").read_text())
  hf.update(sliding_window=64, custom_field="kept")
  (base / "config.json").write_text(json.dumps(hf))
  (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
  out = tmp_path / "merged"
  assert (
      cli.main(["export", "--run", str(root / "run"), "--format", "merged", "--out", str(out)]) == 0
  )
  merged = json.loads((out / "config.json").read_text())
  for key in ("bos_token_id", "eos_token_id", "pad_token_id", "sliding_window", "custom_field"):
    assert merged[key] == hf[key], key
  assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [2, 5]}
  assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
  assert all((p.stat().st_mode & 0o777) == 0o644 for p in out.iterdir() if p.is_file())


def test_the_step_guard_is_what_keeps_a_nan_update_out():
  from anlr_jax.train.step import init_train_state, make_train_step, split_model

  graphdef, lora, frozen, extra = split_model(make_toy_model())
  batch = ToyBatches().get_batch(0)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  batch["loss_mask"] = jnp.full_like(batch["loss_mask"], jnp.inf)
  tx = optax.adamw(1e-2)
  for guarded in (True, False):
    state = init_train_state(lora, extra, tx)
    new, metrics = jax.jit(make_train_step(graphdef, tx, skip_nonfinite=guarded))(
        state, frozen, batch
    )
    finite = all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new.lora))
    assert finite == guarded and float(metrics["skipped"]) == 1.0
