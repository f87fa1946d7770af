"""``anlr train`` as a ``jax.distributed`` job on localhost: 2 processes x 4 fake CPU devices train,
evaluate and write the same run as 1 process x 8 devices; only process 0 writes; a process that
fails or is killed stops the other in bounded time with one line; the job resumes afterwards.

Same numbers: both layouts run the same global (2, 2, 2) mesh over 8 CPU devices, so every
collective reduces the same shards in the same order. The adapters and per-step losses are compared
to 1e-6 relative: in the 2-process job every collective (also one among the devices of one process)
runs through gloo's own summation code rather than XLA's in-process one, which may round the last
bit differently.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from anlr_jax.app import cli
from anlr_jax.train.lock import DirectoryLock
from tests.helpers.tiny_run import tiny_run_setup

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = [
    "trainer.devices=null",
    "trainer.mesh_data=2",
    "trainer.mesh_fsdp=2",
    "trainer.mesh_tensor=2",
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
  env = dict(
      os.environ,
      PYTHONPATH=REPO,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}",
      **extra,
  )
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    if var not in extra:
      env.pop(var, None)
  return env


def _start(config, overrides, *, processes: int):
  """Starts ``anlr train`` as ``processes`` processes of one job (4 devices each)."""
  args = [sys.executable, "-m", "anlr_jax", "train", "--config", str(config), *MESH, *overrides]
  port = _free_port()
  return [
      subprocess.Popen(
          args + ["distributed.peer_timeout_s=6"],
          cwd=REPO,
          env=_env(
              4,
              JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
              JAX_NUM_PROCESSES=str(processes),
              JAX_PROCESS_ID=str(pid),
          ),
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for pid in range(processes)
  ]


def _finish(procs, timeout=400):
  out = []
  try:
    for proc in procs:
      stdout, stderr = proc.communicate(timeout=timeout)
      out.append((proc.returncode, stdout, stderr))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  return out


def _run(config, overrides, *, processes):
  results = _finish(_start(config, overrides, processes=processes))
  for code, _, stderr in results:
    assert code == 0, stderr[-3000:]
  return results


def _losses(run: pathlib.Path) -> np.ndarray:
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
  return np.array([[r["loss"], r["grad_norm"]] for r in rows])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("multihost")
  config = tiny_run_setup(root, layers=1)  # the layers' count is not the point: 1 compiles faster
  raw = yaml.safe_load(config.read_text())
  raw["trainer"].update(save_every=2, log_every=1)
  config.write_text(yaml.safe_dump(raw))
  return root, config


@pytest.mark.slow
def test_two_processes_train_and_evaluate_like_one(setup):
  root, config = setup
  two = _run(config, [f"run_dir={root / 'two'}"], processes=2)
  # the one-process run in this process: the same 8 CPU devices, mesh and code path
  argv = ["train", "--config", str(config), *MESH, f"run_dir={root / 'one'}"]
  assert cli.main(argv) == 0
  assert "run directory:" in two[0][1] and "run directory:" not in two[1][1]  # process 0 reports
  np.testing.assert_allclose(_losses(root / "two"), _losses(root / "one"), rtol=1e-6)
  assert len(set(np.round(_losses(root / "one")[:, 0], 5))) == 4  # the steps really move
  a, b = (load_file(root / name / "lora_final.safetensors") for name in ("two", "one"))
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7)
  results = [json.loads((root / n / "results.json").read_text()) for n in ("two", "one")]
  assert results[0]["accuracy"] == results[1]["accuracy"]  # evaluation ran on the job too
  assert sorted(p for p in os.listdir(root / "two" / "checkpoints") if p.isdigit()) == ["2", "4"]


def test_a_failing_process_stops_the_other_with_one_line(setup):
  """Process 0 cannot take the run directory's lock (held here): it fails with one line, and
  process 1 (which holds no lock) stops within seconds naming process 0 and its error."""
  root, config = setup
  run = root / "locked"
  run.mkdir()
  with DirectoryLock(str(run), what="run directory"):
    start = time.monotonic()
    results = _finish(_start(config, [f"run_dir={run}"], processes=2), timeout=120)
  elapsed = time.monotonic() - start
  (code0, _, err0), (code1, _, err1) = results
  assert code0 == 2 and "in use by another anlr process" in err0, err0[-2000:]
  assert code1 == 4, err1[-2000:]
  line = [l for l in err1.splitlines() if "anlr train: error" in l]
  assert len(line) == 1 and "process 0 of 2 failed (DirectoryLockedError" in line[0], err1[-2000:]
  assert "Traceback" not in err0 + err1
  assert elapsed < 90
  assert not (run / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_killed_process_stops_the_other_and_the_job_resumes(setup):
  root, config = setup
  run = root / "killed"
  overrides = [f"run_dir={run}", "trainer.steps=400", "trainer.save_every=4"]
  procs = _start(config, overrides, processes=2)
  sealed = run / "checkpoints" / "4" / "anlr_checksums.json"
  deadline = time.monotonic() + 300
  while not sealed.exists() and time.monotonic() < deadline and procs[0].poll() is None:
    time.sleep(0.05)
  assert sealed.exists(), procs[0].stderr.read()[-3000:] if procs[0].poll() is not None else ""
  procs[1].kill()  # SIGKILL: no message, no failure report, heartbeats stop
  killed = time.monotonic()
  ((code0, _, err0),) = _finish(procs[:1], timeout=120)
  procs[1].wait()
  assert code0 == 4 and time.monotonic() - killed < 60, err0[-2000:]
  lines = [l for l in err0.splitlines() if "anlr train: error" in l]
  # the survivor sees its peer's heartbeats stop, or (killed mid-collective) gloo fails in one of
  # its threads first: either way one line, exit 4
  said = ("process 1 of 2 sent no heartbeat", "the collectives library stopped with gloo::")
  assert len(lines) == 1 and any(s in lines[0] for s in said), err0[-2000:]
  saved = sorted(int(p) for p in os.listdir(run / "checkpoints") if p.isdigit())
  assert saved and saved[-1] < 400
  steps = saved[-1] + 4
  again = [f"trainer.steps={steps}", "trainer.save_every=4", "trainer.resume_allow=[trainer.steps]"]
  resumed = _run(config, overrides[:1] + again, processes=2)
  assert f"resumed at update {saved[-1]}" in resumed[0][1]
  assert len(_losses(run)) == steps and (run / "lora_final.safetensors").is_file()


def test_the_distributed_section_reaches_jax_distributed(monkeypatch):
  """Config keys (or cluster detection) are what jax.distributed.initialize gets; one process
  without a coordinator does nothing; a partial setting is one ConfigError naming the section."""
  import jax

  from anlr_jax.app.config import load_config
  from anlr_jax.app.distributed_job import distributed_job
  from anlr_jax.settings import ConfigError

  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  calls = []

  class Stop(Exception):
    pass

  def initialize(**kwargs):
    calls.append(kwargs)
    raise Stop

  monkeypatch.setattr(jax.distributed, "initialize", initialize)
  monkeypatch.setattr(jax.config, "update", lambda *a: None)  # the CPU collectives switch
  section = lambda *o: load_config(None, list(o)).distributed  # noqa: E731
  with distributed_job(section()) as job:
    assert job is None and not calls
  keys = ["distributed.coordinator_address=h0:1234", "distributed.num_processes=4"]
  with pytest.raises(Stop):
    with distributed_job(section(*keys, "distributed.process_id=3")):
      pass
  assert calls[-1]["coordinator_address"] == "h0:1234" and calls[-1]["process_id"] == 3
  assert calls[-1]["num_processes"] == 4 and calls[-1]["heartbeat_timeout_seconds"] == 130
  with pytest.raises(Stop):
    with distributed_job(section("distributed.cluster_detection=true")):
      pass
  assert set(calls[-1]) == {"heartbeat_timeout_seconds"}  # JAX reads SLURM / Cloud TPU itself
  with pytest.raises(ConfigError, match="distributed: .*JAX_PROCESS_ID"):
    with distributed_job(section(*keys)):
      pass
