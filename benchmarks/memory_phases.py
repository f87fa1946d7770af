r"""Where a JAX train step's process memory goes, phase by phase: AdamW vs AnLR.

Each optimizer runs in a fresh subprocess (same model, batch and LoRA config as
``benchmarks/train_step.py``). Around each phase — build the model and state, lower, compile, run
the warmup steps, run the timed steps — the worker returns freed heap to the OS (``malloc_trim``)
and records the resident set (RSS) and glibc's ``mallinfo2`` counters: bytes in live allocations
(``inuse``) and free bytes kept in the allocator's arenas (``arena_free``). It also reports the
compiled step's XLA buffer total (``memory_analysis``), its serialised size, its HLO line count and
the peak RSS of the timed steps (``VmHWM`` reset after warmup, as ``train_step.py`` measures it).

    python benchmarks/memory_phases.py                      # reference config
    python benchmarks/memory_phases.py --layers 2 --json out.json
    python benchmarks/memory_phases.py --attribute          # + who holds the compiler's memory
    python benchmarks/memory_phases.py --repeats 7          # ratios over 7 rounds, + an A/A control

``--repeats N`` runs N rounds of fresh processes, each round AdamW, AnLR and a second AdamW process
(the control: two identical processes, whose ratio shows how far RSS differs between runs of the
same thing), in a rotating order, and prints the median and range of every ratio over the rounds.

``--attribute`` (needs ``pip install memray``) also traces every native allocation made while the
step compiles and reports the compiler's peak heap and, by component (HLO module, buffer
assignment, thunks, YNNPACK runtimes, MLIR fusion compiler, LLVM), the heap still held once
compilation has returned: what the compiled executable keeps.

Linux + glibc only (``/proc/self``, ``mallinfo2``); on other systems the allocator columns are empty.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    BenchConfig,
    JaxStep,
    add_config_flags,
    config_from_args,
    current_rss_mib,
    emit_result,
    jax_optimizer,
    machine_line,
    release_free_heap,
    reset_peak_rss,
    run_worker,
    status_mib,
    thread_env,
    write_json,
)

OPTIMIZERS = ("adamw", "anlr")
CONTROL = "adamw-control"  # a second, identical AdamW process (--repeats)
PHASES = ("start", "built", "lowered", "compiled", "warmup", "steps")


class _MallInfo2(ctypes.Structure):
  _names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
  _fields_ = [(name, ctypes.c_size_t) for name in _names.split()]


def allocator_mib() -> dict:
  """glibc ``mallinfo2``: live allocation bytes and free bytes held in arenas, in MiB ({} if absent)."""
  try:
    fn = ctypes.CDLL("libc.so.6").mallinfo2
  except (OSError, AttributeError):
    return {}
  fn.restype = _MallInfo2
  m = fn()
  return {"inuse": (m.uordblks + m.hblkhd) / 2**20, "arena_free": m.fordblks / 2**20}


def snapshot() -> dict:
  gc.collect()
  release_free_heap()
  return {"rss": current_rss_mib(), **allocator_mib()}


# Native allocations are charged to the first frame (innermost first) that matches a component; the
# patterns of a component are separated by spaces.
COMPONENTS = (
    (
        "buffer assignment",
        "BufferAssign HloDataflowAnalysis HloAliasAnalysis HloBuffer HloValue HloUse",
    ),
    ("thunks", "Thunk"),
    ("YNNPACK runtimes", "ynn slinky"),
    ("HLO module", "xla::Hlo xla::OpMetadata xla::Shape xla::Layout xla::Literal xla::CallGraph"),
    ("MLIR fusion compiler", "mlir:: FusionCompiler"),
    ("LLVM", "llvm::"),
)


def component(frames) -> str:
  """The component an allocation's native stack (innermost frame first) belongs to."""
  for name in frames:
    for label, patterns in COMPONENTS:
      if any(p in name for p in patterns.split()):
        return label
  return "other"


def traced_compile(lowered, path: str):
  """Compiles under memray's native tracer; returns the executable and the heap figures (MiB)."""
  try:
    import memray
  except ImportError as e:
    raise SystemExit("--attribute needs memray: pip install memray") from e
  if os.path.exists(path):
    os.remove(path)
  with memray.Tracker(path, native_traces=True):
    compiled = lowered.compile()
  reader = memray.FileReader(path)
  held = {}
  for record in reader.get_leaked_allocation_records(merge_threads=True):
    label = component(frame[0] for frame in record.native_stack_trace())
    held[label] = held.get(label, 0.0) + record.size / 2**20
  os.remove(path)
  return compiled, {
      "compile_peak_heap": reader.metadata.peak_memory / 2**20,
      "compile_allocations": reader.metadata.total_allocations,
      "held_after_compile": held,
  }


def worker(
    cfg: BenchConfig,
    optimizer: str,
    steps: int,
    attribute: bool = False,
    batch_modules: bool | None = None,
) -> dict:
  from jax.experimental.serialize_executable import serialize

  phases, traced = {"start": snapshot()}, {}

  def compile_fn(lowered):
    if not attribute:
      return lowered.compile()
    compiled, figures = traced_compile(lowered, f"/tmp/memory_phases_{os.getpid()}.bin")
    traced.update(figures)
    return compiled

  step = JaxStep(
      cfg,
      jax_optimizer(optimizer, batch_modules=batch_modules),
      on_phase=lambda name: phases.update({name: snapshot()}),  # built, lowered, compiled
      compile_fn=compile_fn,
  )
  step(2)  # warmup: two steps back to back
  phases["warmup"] = snapshot()
  reset_peak_rss()
  for _ in range(steps):
    step()
  phases["steps"] = snapshot()
  return {
      "phases": phases,
      "step_peak_rss": status_mib("VmHWM"),
      "xla_mib": step.xla["peak_bytes"] / 2**20,
      "serialized_mib": len(serialize(step.compiled)[0]) / 2**20,
      "hlo_lines": len(step.compiled.as_text().splitlines()),
      **traced,
  }


def run(
    cfg: BenchConfig,
    steps: int,
    timeout: float = 900.0,
    attribute: bool = False,
    batch_modules: bool | None = None,
    names: tuple[str, ...] = OPTIMIZERS,
) -> dict:
  """Runs each of ``names`` (optimizers, or :data:`CONTROL`: AdamW again) in its own process, in
  that order; returns ``{name: worker result}``."""
  results = {}
  for name in names:
    optimizer = "adamw" if name == CONTROL else name
    argv = [sys.executable, os.path.abspath(__file__), "--worker", optimizer]
    argv += ["--config-json", cfg.to_json(), "--steps", str(steps)]
    argv += ["--attribute"] if attribute else []
    argv += [] if batch_modules is None else ["--batch-modules", str(batch_modules).lower()]
    try:
      results[name] = run_worker(
          argv, timeout=timeout, env=thread_env(cfg.threads), capture_stderr=True
      )
    except RuntimeError as e:
      raise RuntimeError(f"memory_phases worker {optimizer!r} failed: {e}") from None
  return results


def repeated_summary(rounds: list[dict]) -> tuple[str, dict]:
  """Median and range over ``rounds`` (``run(...)`` results with the control) of AnLR / AdamW and
  control / AdamW: step peak RSS ratio, and RSS and live-heap differences after the timed steps."""

  def stats(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}

  table = {}
  for other in ("anlr", CONTROL):
    table[other] = {
        "step_peak_rss_ratio": stats(
            [r[other]["step_peak_rss"] / r["adamw"]["step_peak_rss"] for r in rounds]
        ),
        "rss_diff_mib": stats(
            [
                r[other]["phases"]["steps"]["rss"] - r["adamw"]["phases"]["steps"]["rss"]
                for r in rounds
            ]
        ),
    }
    if all("inuse" in r[o]["phases"]["steps"] for r in rounds for o in (other, "adamw")):
      table[other]["live_heap_diff_mib"] = stats(
          [
              r[other]["phases"]["steps"]["inuse"] - r["adamw"]["phases"]["steps"]["inuse"]
              for r in rounds
          ]
      )
  lines = [f"over {len(rounds)} rounds of fresh processes: median [min, max]"]
  labels = {
      "step_peak_rss_ratio": ("step peak RSS / adamw's", "{:.4f}"),
      "rss_diff_mib": ("RSS after the steps - adamw's, MiB", "{:+.1f}"),
      "live_heap_diff_mib": ("live heap after the steps - adamw's, MiB", "{:+.1f}"),
  }
  for key, (label, fmt) in labels.items():
    cells = []
    for other in ("anlr", CONTROL):
      if key in table[other]:
        v = table[other][key]
        cells.append(
            f"{other} {fmt.format(v['median'])} [{fmt.format(v['min'])}, {fmt.format(v['max'])}]"
        )
    if cells:
      lines.append(f"  {label}: " + "; ".join(cells))
  return "\n".join(lines), table


def report(cfg: BenchConfig, results: dict) -> str:
  a, b = results["adamw"], results["anlr"]
  lines = [
      f"machine: {machine_line()}; {time.strftime('%Y-%m-%d %H:%M %Z')}",
      f"config: hidden {cfg.hidden}, {cfg.layers} layers, batch {cfg.batch} x {cfg.seq}, LoRA r={cfg.rank}, {cfg.lora_layout} LoRA layout",
      "MiB after each phase (freed heap returned to the OS first): RSS / live allocations / arena free",
      f"{'phase':<10} {'adamw':>24} {'anlr':>24} {'RSS anlr - adamw':>17}",
  ]

  def cell(p):
    alloc = f" / {p['inuse']:6.1f} / {p['arena_free']:6.1f}" if "inuse" in p else ""
    return f"{p['rss']:7.1f}{alloc}"

  for phase in PHASES:
    pa, pb = a["phases"][phase], b["phases"][phase]
    lines.append(f"{phase:<10} {cell(pa):>24} {cell(pb):>24} {pb['rss'] - pa['rss']:+17.1f}")
  for key, label in (
      ("step_peak_rss", "step peak RSS (VmHWM over the timed steps)"),
      ("xla_mib", "XLA buffers (memory_analysis)"),
      ("serialized_mib", "serialised executable"),
      ("hlo_lines", "optimised HLO lines"),
  ):
    lines.append(f"{label}: adamw {a[key]:.1f}, anlr {b[key]:.1f}, ratio {b[key] / a[key]:.4f}")
  if "held_after_compile" in a:
    lines.append("(with --attribute the RSS figures include memray's own tracking overhead)")
    lines.append(
        f"compiler peak heap (memray): adamw {a['compile_peak_heap']:.1f}, anlr "
        f"{b['compile_peak_heap']:.1f} MiB; allocations {a['compile_allocations']} / "
        f"{b['compile_allocations']}"
    )
    lines.append(f"{'heap held after compiling, MiB':<32} {'adamw':>8} {'anlr':>8} {'diff':>8}")
    ha, hb = a["held_after_compile"], b["held_after_compile"]
    for label in sorted(set(ha) | set(hb), key=lambda k: -(hb.get(k, 0) - ha.get(k, 0))):
      x, y = ha.get(label, 0.0), hb.get(label, 0.0)
      lines.append(f"{label:<32} {x:8.1f} {y:8.1f} {y - x:+8.1f}")
    x, y = sum(ha.values()), sum(hb.values())
    lines.append(f"{'total':<32} {x:8.1f} {y:8.1f} {y - x:+8.1f}")
  return "\n".join(lines)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  add_config_flags(ap)
  ap.add_argument("--steps", type=int, default=5, help="timed steps after the warmup")
  ap.add_argument("--json", default=None, help="also write the results to this JSON file")
  ap.add_argument(
      "--attribute",
      action="store_true",
      help="trace the compiler's native allocations with memray (pip install memray)",
  )
  ap.add_argument(
      "--batch-modules",
      choices=("true", "false"),
      default=None,
      help="anlr(batch_modules=...): statistics stacked per group of same-shaped modules (true) or"
      " module by module (false); default: the backend's default",
  )
  ap.add_argument(
      "--repeats",
      type=int,
      default=1,
      help="rounds of fresh processes; above 1, each round adds an A/A control (AdamW twice)",
  )
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--config-json", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  batch_modules = None if args.batch_modules is None else args.batch_modules == "true"
  if args.worker:
    if args.worker not in OPTIMIZERS:
      raise ValueError(f"--worker {args.worker!r} must be one of {OPTIMIZERS}")
    cfg = BenchConfig.from_json(args.config_json)
    result = worker(cfg, args.worker, args.steps, args.attribute, batch_modules)
    emit_result(result)
    return result
  cfg = config_from_args(args)
  if args.attribute:
    try:
      import memray  # noqa: F401  (fail here, before the workers start)
    except ImportError as e:
      raise SystemExit("--attribute needs memray: pip install memray") from e
  if args.repeats < 1:
    raise ValueError(f"--repeats={args.repeats} must be >= 1")
  if args.repeats == 1:
    results = run(cfg, args.steps, attribute=args.attribute, batch_modules=batch_modules)
    text = report(cfg, results)
    out = {"config": json.loads(cfg.to_json()), "results": results, "report": text}
  else:
    names = ("adamw", "anlr", CONTROL)
    rounds = []
    for i in range(args.repeats):
      order = names[i % 3 :] + names[: i % 3]  # each name first, second and third equally often
      rounds.append(
          run(cfg, args.steps, attribute=args.attribute, batch_modules=batch_modules, names=order)
      )
      print(f"round {i + 1}/{args.repeats} ({', '.join(order)}) done", file=sys.stderr, flush=True)
    summary, table = repeated_summary(rounds)
    results = rounds[0]
    text = report(cfg, results) + "\n(the table above: round 1)\n" + summary
    out = {
        "config": json.loads(cfg.to_json()),
        "results": results,
        "rounds": rounds,
        "summary": table,
        "report": text,
    }
  print(text)
  if args.json:
    write_json(args.json, out, indent=1)
  return out


if __name__ == "__main__":
  main()
