r"""What scaling out costs on one machine: ``anlr train`` as 2 processes x 4 CPU devices next to
1 process x 8 devices (the same global mesh, gloo between the processes), and the checksum that
seals a checkpoint next to the orbax save it follows.

Step time: the shipped quickstart model and data (``configs/quickstart.yaml``, method ``lora``,
``--steps`` updates, mesh data 2 x fsdp 2 x tensor 2, no evaluation), each layout run ``--rounds``
times, alternating; a run's step time is the median over its updates after the first two (compile)
of ``tokens / tokens_per_s`` from ``metrics.jsonl``. Localhost is no network and both layouts share
the same cores, so this is a check that the multi-process path adds no large overhead (a ratio near
2 would say something is wrong), not a speed figure.

Checksums: a :class:`anlr_jax.train.checkpoint.TrainCheckpointer` saves a float32 train state of
``--mib`` MiB (LoRA params + Adam's two moments, random), ``--saves`` times; each save's wall time
until orbax has committed it, and the SHA-256 sealing's time that follows in the background.

    python benchmarks/multihost_cost.py --rounds 3 --steps 30 --mib 16,64,256
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_line, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def train_once(processes: int, steps: int, run_dir: str) -> float:
  """One ``anlr train`` run; returns its median step time in seconds."""
  args = [sys.executable, "-m", "anlr_jax", "train", "--config", "quickstart", "method=lora"]
  args += ["compare=[]", f"run_dir={run_dir}", f"trainer.steps={steps}", "trainer.log_every=1"]
  args += ["trainer.mesh_data=2", "trainer.mesh_fsdp=2", "trainer.mesh_tensor=2"]
  args += ["trainer.diag_every=0", "eval.tasks={}", "eval.include_base=false", "compile_cache=null"]
  base = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    base.pop(var, None)
  port = _free_port()
  procs = []
  for pid in range(processes):
    env = dict(base, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}")
    if processes > 1:
      env.update(
          JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
          JAX_NUM_PROCESSES=str(processes),
          JAX_PROCESS_ID=str(pid),
      )
    procs.append(
        subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    )
  for proc in procs:
    _, err = proc.communicate(timeout=1800)
    if proc.returncode:
      raise RuntimeError(f"anlr train ({processes} processes) failed: {err.decode()[-2000:]}")
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return statistics.median(r["tokens"] / r["tokens_per_s"] for r in rows[2:])


def checksum_cost(mib: int, saves: int, directory: str) -> dict:
  """Median orbax save time (until committed) and sealing time of a ``mib`` MiB state."""
  import jax
  import numpy as np

  from anlr_jax.train.checkpoint import TrainCheckpointer

  n = mib * 2**20 // 4 // 3  # params, mu, nu
  rng = np.random.default_rng(0)
  leaf = lambda: jax.numpy.asarray(rng.standard_normal(n, np.float32))  # noqa: E731
  state = {"lora": leaf(), "mu": leaf(), "nu": leaf()}
  checkpointer = TrainCheckpointer(directory, keep=2)
  save_s = []
  for step in range(1, saves + 1):
    start = time.perf_counter()
    checkpointer.save(step, state, {"step": step}, force=True)
    checkpointer.manager.wait_until_finished()
    save_s.append(time.perf_counter() - start)
    checkpointer.wait()
  checkpointer.close()
  seal_s = list(checkpointer.seal_seconds.values())
  return {
      "mib": mib,
      "save_s": statistics.median(save_s),
      "seal_s": statistics.median(seal_s),
      "seal_over_save": statistics.median(seal_s) / statistics.median(save_s),
      "seal_mib_per_s": mib / statistics.median(seal_s),
  }


def main(argv=None):
  ap = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument("--rounds", type=int, default=3, help="runs of each layout, alternating")
  ap.add_argument("--steps", type=int, default=30, help="updates per run")
  ap.add_argument("--mib", default="16,64,256", help="checkpoint sizes (MiB), comma-separated")
  ap.add_argument("--saves", type=int, default=3, help="saves of each size")
  ap.add_argument("--out", help="write the results as JSON here")
  args = ap.parse_args(argv)
  if args.rounds < 1 or args.steps < 4 or args.saves < 1:
    raise ValueError("--rounds >= 1, --steps >= 4, --saves >= 1")
  times = {1: [], 2: []}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
      for processes in ((1, 2) if r % 2 == 0 else (2, 1)):
        run_dir = os.path.join(tmp, f"run-{processes}-{r}")
        times[processes].append(train_once(processes, args.steps, run_dir))
        print(f"round {r}: {processes} process(es): {1e3 * times[processes][-1]:.1f} ms/step",
              file=sys.stderr)  # fmt: skip
    costs = [
        checksum_cost(int(m), args.saves, os.path.join(tmp, f"ckpt-{m}"))
        for m in args.mib.split(",")
        if m
    ]
  one, two = (statistics.median(times[p]) for p in (1, 2))
  result = dict(
      machine=machine_line(),
      date=time.strftime("%Y-%m-%d"),
      steps=args.steps,
      rounds=args.rounds,
      step_ms={"1x8": [1e3 * t for t in times[1]], "2x4": [1e3 * t for t in times[2]]},
      ratio_2x4_over_1x8=two / one,
      checksums=costs,
  )
  print(f"{result['machine']}; quickstart model, method lora, mesh 2x2x2, {args.steps} updates")
  print(f"{'layout':<22}{'median ms/step':>16}")
  print(f"{'1 process x 8 dev':<22}{1e3 * one:>16.1f}")
  print(f"{'2 processes x 4 dev':<22}{1e3 * two:>16.1f}")
  print(f"ratio 2x4 / 1x8: {two / one:.3f}")
  print(f"{'checkpoint MiB':<16}{'save s':>9}{'seal s':>9}{'seal/save':>11}{'seal MiB/s':>12}")
  for c in costs:
    print(
        f"{c['mib']:<16}{c['save_s']:>9.3f}{c['seal_s']:>9.3f}{c['seal_over_save']:>11.3f}"
        f"{c['seal_mib_per_s']:>12.0f}"
    )
  if args.out:
    write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
