"""Checkpoints sealed inside orbax's commit (a process killed the moment a checkpoint is committed
leaves it sealed), corrupt checkpoints skipped with one line naming the one restored instead, and a
roll-back past a checkpoint whose values train to NaN (damaged before its seal could see it)."""

import json
import logging
import os
import shutil
import subprocess
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from anlr_jax.train.checkpoint import CHECKSUM_FILE, TrainCheckpointer, seal_directory
from anlr_jax.train.metrics import read_metrics
from anlr_jax.train.trainer import ROLLBACK_WINDOW, NonFiniteError, Trainer, TrainerConfig
from tests.helpers.toy_lm import ONE_DEVICE, ToyBatches, make_toy_model, make_toy_trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _library_warnings_reach_caplog(monkeypatch):
  monkeypatch.setattr(logging.getLogger("anlr_jax"), "propagate", True)


@pytest.fixture(autouse=True, scope="module")
def _compile_each_program_once():
  """The trainers here compile the same few programs again and again: JAX's persistent compilation
  cache (the session's, as ``anlr train`` turns it on) compiles each once."""
  from anlr_jax.app.cli import use_compile_cache

  use_compile_cache(os.environ.get("ANLR_COMPILE_CACHE") or None)


def _trainer(tmp_path, steps=6, **kw):
  return make_toy_trainer(
      optax.adamw(1e-2),
      one_device=True,
      checkpoint_dir=tmp_path / "ckpt",
      log_dir=tmp_path / "run",
      **{"steps": steps, "save_every": 2, "keep": 3, **kw},
  )


def test_every_file_of_a_checkpoint_is_sealed_within_its_commit(tmp_path):
  trainer = _trainer(tmp_path)
  trainer.run(steps=4)
  checkpointer = trainer.checkpointer
  trainer.close()
  late = {"_CHECKPOINT_METADATA", "commit_success.txt"}  # orbax writes these in its commit
  for step in (2, 4):
    folder = tmp_path / "ckpt" / str(step)
    seal = json.loads((folder / CHECKSUM_FILE).read_text())
    files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert set(seal["files"]) == files - late - {CHECKSUM_FILE}
    assert not list(folder.glob(f"*/**/{CHECKSUM_FILE}"))  # one seal a step, not one an item
    assert seal["step_metadata"] and TrainCheckpointer(tmp_path / "ckpt").verify(step) is None
  assert set(checkpointer.seal_seconds) == {2, 4}


def _poisoned_checkpoint(tmp_path, step, poison):
  """A sealed checkpoint ``step`` after ``step - 1`` updates whose train state is ``poison(state)``:
  finite, readable, and training from it gives NaN (as values damaged before they were sealed)."""
  trainer = _trainer(tmp_path, steps=step - 1)
  trainer.run()
  trainer.close()
  bad = poison(trainer.state)._replace(step=jnp.asarray(step, jnp.int32))
  trainer.replace_state(bad)
  checkpointer = TrainCheckpointer(tmp_path / "ckpt", keep=3)
  trainer.checkpointer = checkpointer
  trainer.save(force=True)
  checkpointer.close()


def _huge_lora(state):
  return state._replace(lora=jax.tree.map(lambda x: jnp.full_like(x, 1e30), state.lora))


def _huge_first_moment(state):
  """Adam's first moment at 1e30: update 1 (of the restored, finite parameters) is finite and moves
  them by a huge step; update 2 and every one after it are not."""
  opt = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.full_like(x, 1e30) if "mu" in jax.tree_util.keystr(path) else x,
      state.opt_state,
  )
  return state._replace(opt_state=opt)


def test_non_finite_updates_right_after_a_restore_roll_back_once_to_the_previous(tmp_path, caplog):
  _poisoned_checkpoint(tmp_path, 3, _huge_lora)
  with caplog.at_level(logging.WARNING, logger="anlr_jax.train"):
    trainer = _trainer(tmp_path, steps=8, max_nonfinite=2, resume_allow=["trainer.steps"])
    assert trainer.step == 3  # finite values: restored
    rows = trainer.run()
  trainer.close()
  (message,) = [r.getMessage() for r in caplog.records if "rolled back" in r.getMessage()]
  assert "updates 4-5 were non-finite, a streak that began 1 update(s) after restoring" in message
  assert "checkpoint 3 in" in message and "rolled back to checkpoint 2" in message
  assert [int(r["step"]) for r in rows] == list(range(1, 9))  # one row per step, from 2 on anew
  assert [int(r["step"]) for r in read_metrics(str(tmp_path / "run"))] == list(range(1, 9))
  assert all(np.isfinite(r["loss"]) for r in rows[2:])
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(trainer.state.lora))
  assert sorted(TrainCheckpointer(tmp_path / "ckpt").all_steps()) == [4, 6, 8]


@pytest.mark.parametrize("save_every, keep", [(2, 4), (1, 8)])
def test_a_streak_that_begins_after_one_finite_update_rolls_back_too(
    tmp_path, caplog, save_every, keep
):
  """A restored checkpoint whose first update is finite and the next ones are not: the streak
  began within ROLLBACK_WINDOW updates of the restore, so the checkpoint is blamed, once, and the
  checkpoints saved from it since go with it (replaced by those of the replay)."""
  _poisoned_checkpoint(tmp_path, 3, _huge_first_moment)
  config = dict(max_nonfinite=3, resume_allow=["trainer.steps"], save_every=save_every, keep=keep)
  with caplog.at_level(logging.WARNING, logger="anlr_jax.train"):
    trainer = _trainer(tmp_path, steps=10, **config)
    assert trainer.step == 3
    rows = trainer.run()
  trainer.close()
  messages = [r.getMessage() for r in caplog.records if r.name.startswith("anlr_jax")]
  (message,) = messages
  assert "updates 5-7 were non-finite, a streak that began 2 update(s) after restoring" in message
  assert "checkpoint 3 in" in message and message.endswith("rolled back to checkpoint 2")
  assert [int(r["step"]) for r in rows] == list(range(1, 11))
  assert all(np.isfinite(r["loss"]) for r in rows[2:]) and rows[-1]["skipped_total"] == 0
  steps = TrainCheckpointer(tmp_path / "ckpt").all_steps()
  assert steps == ([4, 6, 8, 10] if save_every == 2 else list(range(3, 11)))
  again = _trainer(tmp_path, steps=10, **config)
  for step in steps:  # none holds the huge parameters of the finite update after the restore
    again.restore(step)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(again.state.lora)) < 1e3
  again.close()


def test_a_streak_that_begins_later_than_the_window_is_the_runs_own(tmp_path):
  """The same damage, found only after ROLLBACK_WINDOW clean updates (a batch source poisoned from
  then on): no rollback, the run stops naming the streak."""

  class PoisonedLater(ToyBatches):

    def get_batch(self, step, **kw):
      batch = super().get_batch(step, **kw)
      if step >= 3 + ROLLBACK_WINDOW:
        batch = dict(batch, loss_mask=np.full_like(batch["loss_mask"], np.inf))
      return batch

  _poisoned_checkpoint(tmp_path, 3, lambda state: state)
  trainer = _trainer(
      tmp_path,
      steps=12,
      max_nonfinite=2,
      resume_allow=["trainer.steps"],
      batches=PoisonedLater(),
  )
  assert trainer.step == 3
  with pytest.raises(NonFiniteError, match=rf"steps {4 + ROLLBACK_WINDOW}-{5 + ROLLBACK_WINDOW}"):
    trainer.run()
  trainer.close()
  assert 3 in TrainCheckpointer(tmp_path / "ckpt").all_steps()  # not blamed


def test_a_second_non_finite_streak_stops_the_run_naming_both_checkpoints(tmp_path):
  class Poisoned(ToyBatches):

    def get_batch(self, step, **kw):
      batch = super().get_batch(step, **kw)
      return dict(batch, loss_mask=np.full_like(batch["loss_mask"], np.inf))

  _poisoned_checkpoint(tmp_path, 3, _huge_lora)
  cfg = TrainerConfig(
      steps=8,
      global_batch=8,
      compute_dtype="float32",
      progress=False,
      save_every=2,
      keep=3,
      max_nonfinite=2,
      resume_allow=["trainer.steps"],
      **ONE_DEVICE,
  )
  trainer = Trainer(
      make_toy_model(),
      Poisoned(),
      cfg,
      optax.adamw(1e-2),
      checkpoint_dir=str(tmp_path / "ckpt"),
      devices=jax.devices()[:1],
  )
  with pytest.raises(NonFiniteError, match="from checkpoint 3, taken as corrupt, to checkpoint 2"):
    trainer.run()
  trainer.close()


SAVE_EVERY_2 = ["trainer.save_every=2"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  """``anlr train`` of the tiny setup with checkpoints 2 and 4 (sealed): the run that the two tests
  below each copy, then damage as a kill would have left it."""
  from anlr_jax.app import cli
  from tests.helpers.tiny_run import tiny_run_setup

  root = tmp_path_factory.mktemp("trained")
  config = tiny_run_setup(root, layers=1)  # the layers' count is not the point: 1 compiles faster
  assert cli.main(["train", "--config", str(config), f"run_dir={root / 'run'}", *SAVE_EVERY_2]) == 0
  return root


def _copy_of_the_run(trained_run, tmp_path):
  """A copy of the trained run directory (checkpoints inside it), its adapter and results deleted
  as if killed right after its last checkpoint; the ``anlr train`` arguments that resume it."""
  from anlr_jax.rundir import LORA_FILE, RESULTS_FILE

  run = tmp_path / "run"
  shutil.copytree(trained_run / "run", run)
  for name in (LORA_FILE, RESULTS_FILE):
    (run / name).unlink()
  config = trained_run / "tiny.yaml"
  return run, ["train", "--config", str(config), f"run_dir={run}", *SAVE_EVERY_2]


def test_anlr_train_past_a_corrupt_newest_checkpoint_is_one_line_and_no_traceback(
    trained_run, tmp_path, capsys
):
  """The issue's user: a run killed after checkpoint 4 (of 2 and 4), a file of checkpoint 4 cut
  in half; the same command again names it, restores checkpoint 2 and finishes."""
  from anlr_jax.app import cli
  from anlr_jax.rundir import LORA_FILE

  run, args = _copy_of_the_run(trained_run, tmp_path)
  folder = run / "checkpoints" / "4"
  victim = max(
      (p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE),
      key=lambda p: p.stat().st_size,
  )
  victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  capsys.readouterr()
  assert cli.main(args) == 0
  captured = capsys.readouterr()
  assert "Traceback" not in captured.err + captured.out
  lines = [l for l in captured.err.splitlines() if "checkpoint 4" in l]
  assert len(lines) == 1 and lines[0].endswith("restored checkpoint 2 instead"), captured.err
  assert "resumed at update 2" in captured.out
  assert (run / LORA_FILE).is_file()


def _truncate_state_data(folder):
  """Cuts the largest data file of checkpoint ``folder``'s array item in half."""
  victim = max(
      (p for p in (folder / "state" / "d").iterdir() if p.is_file()), key=lambda p: p.stat().st_size
  )
  victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])


ABANDONED_READS_SCRIPT = r"""
import asyncio, gc, logging, pathlib, sys
import jax.numpy as jnp
from anlr_jax.train.checkpoint import CorruptCheckpointError, TrainCheckpointer, seal_directory
from tests.test_checkpoint_seal import _truncate_state_data

logging.basicConfig(level=logging.WARNING)  # as the CLI: the asyncio logger reaches stderr
root = pathlib.Path(sys.argv[1])
state = {f"w{i}": jnp.full((64, 64), float(i)) for i in range(8)}
checkpointer = TrainCheckpointer(root, keep=2, async_save=False)
checkpointer.save(1, state, {}, force=True)
checkpointer.wait()
_truncate_state_data(root / "1")
seal_directory(str(root / "1"))  # sealed as cut (bad before the seal): orbax meets the bad bytes
try:
  checkpointer.restore(1, state)
except CorruptCheckpointError as err:
  print("named:", str(err)[:300])

# What the dropped reads of that restore report later, made here on purpose, so that this does not
# depend on the race: a completion scheduled on the restore's closed loop (from a finalizer, as
# tensorstore's threads report it) and a read task whose exception nobody retrieved. Next to each,
# one of another kind, which must still be reported.
closed = asyncio.new_event_loop()
closed.close()

class LateRead:
  def __del__(self):
    closed.call_soon_threadsafe(print)

class OtherFailure:
  def __del__(self):
    raise ValueError("another unraisable error")

async def async_deserialize():
  raise ValueError("bad read")

async def some_other_coroutine():
  raise ValueError("another task error")

loop = asyncio.new_event_loop()
tasks = [loop.create_task(async_deserialize()), loop.create_task(some_other_coroutine())]
loop.run_until_complete(asyncio.sleep(0.01))
del tasks
LateRead(); OtherFailure()
gc.collect()
loop.close()
print("done")
"""


def test_a_failed_restore_leaves_no_traceback_of_its_dropped_reads_and_hides_nothing_else(tmp_path):
  """A restore that fails on one bad read leaves orbax's other reads of it running; they report,
  later, "Event loop is closed" and "Task exception was never retrieved" tracebacks. Those alone
  are dropped; errors of any other kind still reach stderr."""
  done = subprocess.run(
      [sys.executable, "-c", ABANDONED_READS_SCRIPT, str(tmp_path / "ckpt")],
      capture_output=True,
      text=True,
      timeout=300,
      cwd=REPO,
      env=dict(os.environ, PYTHONPATH=REPO),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert (
      "named: checkpoint 1 in" in done.stdout
      and "cannot be read" in done.stdout
      and "done" in done.stdout
  )
  assert "Event loop is closed" not in done.stderr, done.stderr[-3000:]
  assert "bad read" not in done.stderr and "async_deserialize" not in done.stderr, done.stderr[
      -3000:
  ]
  assert "another unraisable error" in done.stderr and "another task error" in done.stderr


def test_a_dropped_tensorstore_read_reported_as_a_bare_future_is_dropped_too():
  """On a loaded machine a dropped read can surface as an unretrieved tensorstore future rather than
  an orbax task; that report is dropped, an unretrieved future about anything else is not."""
  import logging

  from anlr_jax.train.checkpoint import _DropAbandonedReads

  def record(message):
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

  read = (
      "Future exception was never retrieved\nfuture: <Future finished exception=ValueError("
      "'OUT_OF_RANGE: Error opening \"zarr\" driver [tensorstore_spec='{}']')>"
  )
  other = (
      "Future exception was never retrieved\nfuture: <Future finished exception=ValueError('x')>"
  )
  drop = _DropAbandonedReads()
  assert not drop.filter(record(read))
  assert drop.filter(record(other))
  assert drop.filter(record("Task exception was never retrieved\ntask: <Task coro=<other()>>"))


def test_anlr_train_past_a_checkpoint_unreadable_as_sealed_has_a_clean_stderr(
    trained_run, tmp_path
):
  """Checkpoint 4 with a file cut in half before it was sealed (its checksums agree): orbax itself
  fails to read it. A fresh process (as a user re-runs the command) prints exactly one line about it
  on stderr, no traceback from the reads the failed restore dropped, and finishes from 2."""
  from anlr_jax.rundir import LORA_FILE

  run, args = _copy_of_the_run(trained_run, tmp_path)
  _truncate_state_data(run / "checkpoints" / "4")
  seal_directory(str(run / "checkpoints" / "4"))
  done = subprocess.run(
      [sys.executable, "-m", "anlr_jax", *args],
      capture_output=True,
      text=True,
      timeout=600,
      cwd=REPO,
      env=dict(os.environ, PYTHONPATH=REPO),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stderr.splitlines()
  assert len(lines) == 1 and "checkpoint 4" in lines[0], done.stderr[-3000:]
  assert lines[0].endswith("restored checkpoint 2 instead")
  assert "resumed at update 2" in done.stdout
  assert (run / LORA_FILE).is_file()


@pytest.fixture(scope="module")
def killed_at_a_commit(tmp_path_factory):
  """Checkpoints 2 and 4 of the toy run (8 devices, frozen weights saved too) of a process
  SIGKILLed the instant orbax renamed checkpoint 4 into place."""
  ckpt = tmp_path_factory.mktemp("killed") / "ckpt"
  args = ["--ckpt", str(ckpt), "--steps", "6", "--save-every", "2", "--kill-after-commit", "4"]
  done = subprocess.run(
      [sys.executable, "-m", "tests.helpers.ckpt_run", *args],
      cwd=REPO,
      env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
  assert "checkpoint 4 committed" in done.stdout
  return ckpt


def _victim(folder, which):
  files = [p for p in folder.rglob("*") if p.is_file()]
  if which == "largest array file":
    return max((p for p in files if p.parent.name == "d"), key=lambda p: p.stat().st_size)
  return folder / which


DAMAGED_FILES = [
    "largest array file",
    "state/_METADATA",
    "state/manifest.ocdbt",
    "frozen/_sharding",
    "meta/metadata",
    "_CHECKPOINT_METADATA",
    CHECKSUM_FILE,
]


@pytest.mark.parametrize(
    "damage, which",
    [("none", None)]
    + [("flip", f) for f in DAMAGED_FILES]
    + [("truncate", f) for f in ("largest array file", "state/_METADATA", "meta/metadata")],
)
def test_a_run_killed_the_instant_a_checkpoint_is_committed_finds_any_damage_to_it(
    killed_at_a_commit, tmp_path, caplog, capsys, damage, which
):
  """Killed with no instant between orbax's commit and the kill, checkpoint 4 is sealed already;
  bytes flipped in any of its files (arrays, orbax's metadata, the OCDBT manifest, the JSON record,
  the seal itself) or a file cut short: the re-run names it in one warning, restores checkpoint 2
  and finishes. Undamaged, it is restored as it is."""
  from tests.helpers import ckpt_run

  ckpt = tmp_path / "ckpt"
  shutil.copytree(killed_at_a_commit, ckpt)
  assert TrainCheckpointer(ckpt).all_steps() == [2, 4]
  assert TrainCheckpointer(ckpt).verify(4) is None  # sealed the instant it was committed
  if damage != "none":
    victim = _victim(ckpt / "4", which)
    data = bytearray(victim.read_bytes())
    if damage == "flip":
      middle = len(data) // 2
      data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    else:
      data = data[: len(data) // 2]
    victim.write_bytes(bytes(data))
  capsys.readouterr()
  with caplog.at_level(logging.WARNING, logger="anlr_jax.train"):
    ckpt_run.main(["--ckpt", str(ckpt), "--steps", "6", "--save-every", "2"])
  out = capsys.readouterr().out
  warnings = [r.getMessage() for r in caplog.records if r.name.startswith("anlr_jax")]
  assert warnings[0].startswith("taking over the lock of")  # the killed process's
  warnings = warnings[1:]
  if damage == "none":
    assert warnings == [] and "resumed at step 4" in out
  else:
    (warning,) = warnings
    assert warning.startswith(f"checkpoint 4 in {ckpt} is corrupt: ")
    assert warning.endswith("restored checkpoint 2 instead") and "resumed at step 2" in out
  assert TrainCheckpointer(ckpt).all_steps()[-1] == 6  # finished


def test_a_step_saved_anew_after_its_deletion_is_verified_anew(tmp_path):
  """verify() answers a step it has checked from memory; a step deleted (as a roll-back does) and
  saved again is a new checkpoint, checked again."""
  state = {"w": jnp.ones((32, 32))}
  checkpointer = TrainCheckpointer(tmp_path, keep=3)
  checkpointer.save(2, state, {}, force=True)
  checkpointer.wait()
  assert checkpointer.verify(2) is None
  checkpointer.manager.delete(2)
  checkpointer.save(2, state, {}, force=True)
  checkpointer.wait()
  victim = _victim(tmp_path / "2", "largest array file")
  victim.write_bytes(victim.read_bytes()[:-8])
  assert "does not match its checksum" in checkpointer.verify(2)
  checkpointer.close()
