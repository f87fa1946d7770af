"""What scaling out costs on one machine: ``anlr train`` as P processes x D CPU devices next to
1 process x P*D devices (the same global mesh, gloo between the processes), the bare gradient
all-reduce in both layouts, and the checksum that seals a checkpoint next to the orbax save it
follows.

Step time: the shipped quickstart model and data (``configs/quickstart.yaml``, method ``lora``,
``--steps`` updates, no evaluation) for each of ``--layouts`` (``2x4=2.2.2``: 2 processes x 4
devices on the mesh data 2 x fsdp 2 x tensor 2), each layout and its 1-process twin run
``--rounds`` times, alternating; a run's step time is the median over its updates after the first
two (compile) of ``tokens / tokens_per_s`` from ``metrics.jsonl``. Localhost is no network and
both layouts share the same cores, so this is a check that the multi-process path adds no large
overhead, not a speed figure.

Where the difference comes from (``--allreduce``): the data-parallel gradient all-reduce alone,
bare, in a job of P processes x D devices and in 1 process x P*D devices: the quickstart LoRA
gradient's buffers (one per LoRA factor, per layer: what XLA's combined all-reduce of the train
step holds) summed over all devices as one multi-buffer all-reduce, and the same floats as one
buffer; the median of ``--reps`` calls each.

Checksums: a :class:`anlr_jax.train.checkpoint.TrainCheckpointer` saves a float32 train state of
``--mib`` MiB (LoRA params + Adam's two moments, random), ``--saves`` times; each save's wall time
until orbax has committed it, and the time of the SHA-256 sealing within that commit.

    python benchmarks/multihost_cost.py --rounds 3 --steps 30 --mib 16,64,256 --allreduce 2x1,2x4
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


def run_job(what: str, args: list[str], processes: int, devices: int, timeout: float) -> list[str]:
  """Runs ``args`` as a ``jax.distributed`` job of ``processes`` processes of ``devices`` CPU
  devices each on localhost (one plain process when ``processes`` is 1); returns each process's
  stdout, or raises with the stderr of the first that failed."""
  base = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")  # fmt: skip
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    base.pop(var, None)
  port = _free_port()
  procs = []
  for pid in range(processes):
    env = dict(base)
    if processes > 1:
      env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                 JAX_PROCESS_ID=str(pid))  # fmt: skip
    procs.append(
        subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    )
  outs = []
  for proc in procs:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode:
      raise RuntimeError(f"{what} ({processes} x {devices} devices) failed: {err.decode()[-2000:]}")
    outs.append(out.decode())
  return outs


def train_once(processes: int, devices: int, mesh: tuple[int, int, int], steps: int,
               run_dir: str) -> float:  # fmt: skip
  """One ``anlr train`` run as ``processes`` processes of ``devices`` CPU devices each on
  ``mesh`` (data, fsdp, tensor); returns its median step time in seconds."""
  args = [sys.executable, "-m", "anlr_jax", "train", "--config", "quickstart", "method=lora"]
  args += ["compare=[]", f"run_dir={run_dir}", f"trainer.steps={steps}", "trainer.log_every=1"]
  args += [f"trainer.mesh_{axis}={size}" for axis, size in zip(("data", "fsdp", "tensor"), mesh)]
  args += ["trainer.diag_every=0", "eval.tasks={}", "eval.include_base=false", "compile_cache=null"]
  run_job("anlr train", args, processes, devices, timeout=1800)
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return statistics.median(r["tokens"] / r["tokens_per_s"] for r in rows[2:])


def parse_layouts(text: str) -> list[tuple[int, int, tuple[int, int, int]]]:
  """``"2x4=2.2.2,2x1=2.1.1"`` -> ``[(P, D, (data, fsdp, tensor)), ...]``."""
  out = []
  for item in filter(None, text.split(",")):
    layout, _, mesh = item.partition("=")
    processes, devices = (int(v) for v in layout.split("x"))
    sizes = tuple(int(v) for v in mesh.split(".")) if mesh else (processes, devices, 1)
    if len(sizes) != 3 or sizes[0] * sizes[1] * sizes[2] != processes * devices:
      raise ValueError(f"--layouts {item!r}: the mesh must cover the {processes * devices} devices")
    out.append((processes, devices, sizes))
  return out


def _gradient_shapes() -> list[tuple[int, ...]]:
  """The shapes of the quickstart LoRA gradient's buffers (each LoRA factor of each layer)."""
  import jax
  from flax import nnx

  from anlr_jax.app.config import load_config
  from anlr_jax.app.assemble import build_method
  from anlr_jax.app.model import load_base
  from anlr_jax.app.paths import find_config

  config = load_config(find_config("quickstart"), ["method=lora", "compare=[]"])
  model, _, _ = load_base(config)
  build_method(config, model=model)
  return [tuple(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))]


def allreduce_worker(reps: int) -> None:
  """One process of :func:`allreduce_once`: times the two all-reduces over every device of the
  job; process 0 prints ``{"buffers", "floats", "many_ms", "one_ms"}`` as JSON."""
  from anlr_jax.train.distributed import initialize_distributed

  initialize_distributed()
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  shapes = _gradient_shapes()
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

  def sharded(shape):
    return jax.make_array_from_callback(
        (n, *shape), NamedSharding(mesh, P("d")), lambda _: np.ones((1, *shape), np.float32)
    )

  psum = jax.jit(jax.shard_map(lambda t: jax.lax.psum(t, "d"), mesh=mesh, in_specs=P("d"),
                               out_specs=P("d")))  # fmt: skip
  many = [sharded(s) for s in shapes]
  one = sharded((sum(int(np.prod(s)) for s in shapes),))

  def median_ms(x):
    for _ in range(3):
      jax.block_until_ready(psum(x))
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      jax.block_until_ready(psum(x))
      times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)

  result = dict(buffers=len(shapes), floats=int(one.shape[1]), many_ms=median_ms(many),
                one_ms=median_ms(one))  # fmt: skip
  if jax.process_index() == 0:
    print(json.dumps(result), flush=True)


def allreduce_once(processes: int, devices: int, reps: int) -> dict:
  """:func:`allreduce_worker` as ``processes`` processes of ``devices`` CPU devices each."""
  args = [sys.executable, os.path.abspath(__file__), "--allreduce-worker", "--reps", str(reps)]
  outs = run_job("all-reduce worker", args, processes, devices, timeout=600)
  return json.loads(outs[0].strip().splitlines()[-1])


def allreduce_cost(layouts: list[tuple[int, int]], reps: int) -> list[dict]:
  """For each ``(P, D)``: the bare gradient all-reduces in P x D and in 1 x P*D, side by side."""
  rows = []
  for processes, devices in layouts:
    multi = allreduce_once(processes, devices, reps)
    single = allreduce_once(1, processes * devices, reps)
    rows.append(dict(
        layout=f"{processes}x{devices}", single=f"1x{processes * devices}",
        buffers=multi["buffers"], floats=multi["floats"],
        many_ms=multi["many_ms"], many_ms_single=single["many_ms"],
        one_ms=multi["one_ms"], one_ms_single=single["one_ms"],
    ))  # fmt: skip
  return rows


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
  ap.add_argument("--allreduce", default="",
                  help="P x D layouts of the bare all-reduce part, e.g. 2x1,2x4 ('': skip)")  # fmt: skip
  ap.add_argument("--reps", type=int, default=20, help="timed calls of each bare all-reduce")
  ap.add_argument("--layouts", default="2x4=2.2.2",
                  help="`anlr train` layouts P x D = data.fsdp.tensor, each next to 1 x P*D")  # fmt: skip
  ap.add_argument("--skip-train", action="store_true", help="no `anlr train` runs")
  ap.add_argument("--allreduce-worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--out", help="write the results as JSON here")
  args = ap.parse_args(argv)
  if args.allreduce_worker:
    return allreduce_worker(args.reps)
  if args.rounds < 1 or args.steps < 4 or args.saves < 1 or args.reps < 1:
    raise ValueError("--rounds >= 1, --steps >= 4, --saves >= 1, --reps >= 1")
  allreduce = allreduce_cost([(p, d) for p, d, _ in parse_layouts(args.allreduce)], args.reps)
  train = parse_layouts(args.layouts)
  times = {(p, d): ([], []) for p, d, _ in train}  # (1 x P*D runs, P x D runs)
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(0 if args.skip_train else args.rounds):
      for processes, devices, mesh in train:
        order = (1, processes) if r % 2 == 0 else (processes, 1)
        for p in order:
          run_dir = os.path.join(tmp, f"run-{processes}x{devices}-{p}-{r}")
          seconds = train_once(p, processes * devices // p, mesh, args.steps, run_dir)
          times[processes, devices][p != 1].append(seconds)
          print(f"round {r}: {p} x {processes * devices // p}, mesh {mesh}: {1e3 * seconds:.1f}"
                " ms/step", file=sys.stderr)  # fmt: skip
    costs = [
        checksum_cost(int(m), args.saves, os.path.join(tmp, f"ckpt-{m}"))
        for m in args.mib.split(",")
        if m
    ]
  steps = []
  for processes, devices, mesh in train:
    one, many = times[processes, devices]
    if one:
      steps.append(dict(
          layout=f"{processes}x{devices}", single=f"1x{processes * devices}", mesh=list(mesh),
          step_ms_single=[1e3 * t for t in one], step_ms=[1e3 * t for t in many],
          ratio=statistics.median(many) / statistics.median(one),
      ))  # fmt: skip
  result = dict(
      machine=machine_line(),
      date=time.strftime("%Y-%m-%d"),
      steps=args.steps,
      rounds=args.rounds,
      train=steps,
      allreduce=allreduce,
      checksums=costs,
  )
  print(f"{result['machine']}; quickstart model, method lora, {args.steps} updates per run")
  if steps:
    print(f"{'P x D':<7}{'mesh':<8}{'median ms/step: 1 x P*D':>25}{'P x D':>9}{'ratio':>8}")
    for row in steps:
      one, many = (statistics.median(row[k]) for k in ("step_ms_single", "step_ms"))
      mesh = "x".join(map(str, row["mesh"]))
      print(f"{row['layout']:<7}{mesh:<8}{one:>25.1f}{many:>9.1f}{row['ratio']:>8.2f}")
  if allreduce:
    print(f"bare gradient all-reduce ({allreduce[0]['buffers']} buffers, "
          f"{allreduce[0]['floats']} floats), median ms of {args.reps} calls")  # fmt: skip
    print(
        f"{'P x D':<7}{'buffers: 1 x P*D':>18}{'P x D':>9}{'one buffer: 1 x P*D':>21}{'P x D':>9}"
    )
    for row in allreduce:
      print(f"{row['layout']:<7}{row['many_ms_single']:>18.2f}{row['many_ms']:>9.2f}"
            f"{row['one_ms_single']:>21.2f}{row['one_ms']:>9.2f}")  # fmt: skip
  if costs:
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
