r"""Step time and memory of the LoRA train step, AdamW vs AnLR, against rank, sequence length and width.

For every point of three one-factor sweeps around a base config (LoRA rank, tokens per row, model
width ``d`` with ``d_ff = 2.6875 d`` and ``d / 64`` heads), the two jitted steps of
``benchmarks/train_step.py`` (``jax-adamw``, ``jax-anlr``) run in their own subprocesses, timed
interleaved; the AnLR overhead share of a step is

.. math::  \mathrm{overhead} = (t_\mathrm{anlr} - t_\mathrm{adamw}) / t_\mathrm{anlr},

with ``t_anlr / t_adamw`` the median over runs of the paired quotient (AnLR's step ``i`` runs in the
same round as AdamW's step ``i``), which cancels the slow load drift of a shared machine. Memory:
XLA's ``memory_analysis`` peak of each compiled step and the peak RSS over the timed steps. Writes
a markdown table, a JSON file and a PNG (matplotlib, Agg).

    python benchmarks/scaling.py --png docs/benchmarks_scaling.png --json /tmp/scaling.json
    python benchmarks/scaling.py --ranks 4,128 --seqs 256 --widths 512 --runs 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    BenchConfig,
    add_config_flags,
    config_from_args,
    machine_line,
    paired_ratio,
    write_json,
)
from benchmarks.train_step import run_workers

NAMES = ("jax-adamw", "jax-anlr")


def _ints(text: str, flag: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError as e:
    raise ValueError(f"{flag}={text!r} must be comma-separated integers") from e
  if not values or min(values) < 1:
    raise ValueError(f"{flag}={text!r} must list positive integers")
  return values


def width_config(base: BenchConfig, width: int) -> BenchConfig:
  """``base`` at residual width ``width``: FFN ``2.6875 width`` (1376 at 512), heads ``width/64``."""
  if width % 64:
    raise ValueError(f"--widths entry {width} must be a multiple of 64 (head size 64)")
  return dataclasses.replace(
      base, hidden=width, ffn=int(round(2.6875 * width / 16)) * 16, heads=width // 64
  )


def measure(cfg: BenchConfig, runs: int, warmup: int) -> dict:
  """Medians, memory and overhead share of ``jax-adamw`` vs ``jax-anlr`` on ``cfg``."""
  workers, failed = run_workers(NAMES, cfg, warmup, runs)
  if failed:
    raise RuntimeError(f"scaling: workers failed: {failed}")
  a, b = workers["jax-adamw"], workers["jax-anlr"]
  ta, tb = statistics.median(a.times_ms), statistics.median(b.times_ms)
  paired = paired_ratio(b.times_ms, a.times_ms)  # step i of each in the same round
  return dict(
      hidden=cfg.hidden,
      ffn=cfg.ffn,
      heads=cfg.heads,
      seq=cfg.seq,
      rank=cfg.rank,
      lora_params=a.info["lora_params"],
      adamw_ms=ta,
      anlr_ms=tb,
      time_ratio=tb / ta,
      paired_ratio=paired,
      overhead_share=1.0 - 1.0 / paired,
      adamw_xla_mib=a.info["xla"]["peak_bytes"] / 2**20,
      anlr_xla_mib=b.info["xla"]["peak_bytes"] / 2**20,
      xla_ratio=b.info["xla"]["peak_bytes"] / a.info["xla"]["peak_bytes"],
      adamw_rss_mib=a.info["steady_peak_rss_mib"],
      anlr_rss_mib=b.info["steady_peak_rss_mib"],
      rss_ratio=b.info["steady_peak_rss_mib"] / a.info["steady_peak_rss_mib"],
  )


def table(rows: list[dict]) -> str:
  head = (
      "| sweep | d | seq | r | LoRA params | adamw ms | anlr ms | anlr/adamw (medians) | paired | overhead share | "
      "XLA MiB adamw / anlr | step RSS MiB adamw / anlr |"
  )
  out = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    out.append(
        f"| {r['sweep']} | {r['hidden']} | {r['seq']} | {r['rank']} | {r['lora_params']/1e6:.2f} M | "
        f"{r['adamw_ms']:.1f} | {r['anlr_ms']:.1f} | {r['time_ratio']:.3f} | {r['paired_ratio']:.3f} | "
        f"{100 * r['overhead_share']:+.1f} % | {r['adamw_xla_mib']:.1f} / {r['anlr_xla_mib']:.1f} | "
        f"{r['adamw_rss_mib']:.0f} / {r['anlr_rss_mib']:.0f} |"
    )
  return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sweeps = [("rank", "LoRA rank r"), ("seq", "tokens per row"), ("hidden", "model width d")]
  fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharex="col")
  for col, (key, label) in enumerate(sweeps):
    pts = sorted((r for r in rows if r["sweep"] == key), key=lambda r: r[key])
    if not pts:
      continue
    x = [r[key] for r in pts]
    top, bottom = axes[0][col], axes[1][col]
    top.plot(x, [r["adamw_ms"] for r in pts], "o-", label="optax.adamw")
    top.plot(x, [r["anlr_ms"] for r in pts], "s--", label="anlr_jax.anlr")
    top.set_ylabel("median step time (ms)")
    top.set_title(f"train step vs {label}")
    top.legend()
    bottom.plot(x, [100 * r["overhead_share"] for r in pts], "o-", color="C2", label="time")
    bottom.plot(x, [100 * (r["xla_ratio"] - 1) for r in pts], "s:", color="C3", label="XLA memory")
    bottom.axhline(0, color="grey", lw=0.5)
    bottom.set_ylabel("AnLR extra over AdamW (%)")
    bottom.set_xlabel(label)
    bottom.legend()
    for ax in (top, bottom):
      ax.set_xscale("log", base=2)
      ax.set_xticks(x, [str(v) for v in x])
  fig.suptitle("AnLR vs AdamW, full LoRA train step (CPU, medians of interleaved runs)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add_config_flags(ap)
  ap.add_argument("--ranks", default="4,16,64,128")
  ap.add_argument("--seqs", default="128,256,512")
  ap.add_argument("--widths", default="256,512,1024")
  ap.add_argument("--runs", type=int, default=7)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--png", help="write the plot here")
  ap.add_argument("--json", help="write the rows here")
  args = ap.parse_args(argv)
  base = config_from_args(args)
  if args.runs < 1:
    raise ValueError(f"--runs={args.runs} must be >= 1")
  points = [("rank", dataclasses.replace(base, rank=r)) for r in _ints(args.ranks, "--ranks")]
  points += [("seq", dataclasses.replace(base, seq=s)) for s in _ints(args.seqs, "--seqs")]
  points += [("hidden", width_config(base, w)) for w in _ints(args.widths, "--widths")]
  rows, done = [], {}
  for sweep, cfg in points:
    key = cfg.to_json()
    if key not in done:  # the base config appears in several sweeps: measure it once
      done[key] = measure(cfg, args.runs, args.warmup)
    rows.append(dict(done[key], sweep=sweep))
    r = rows[-1]
    print(
        f"{sweep:>6}: d={r['hidden']} seq={r['seq']} r={r['rank']}: adamw {r['adamw_ms']:.1f} ms, "
        f"anlr {r['anlr_ms']:.1f} ms, ratio {r['time_ratio']:.3f} (paired {r['paired_ratio']:.3f}), overhead share "
        f"{100 * r['overhead_share']:+.1f} %, XLA memory ratio {r['xla_ratio']:.4f}",
        flush=True,
    )
  print(f"machine: {machine_line()}; median of {args.runs} interleaved runs per point")
  print(table(rows))
  for sweep in ("rank", "seq", "hidden"):
    pts = sorted((r for r in rows if r["sweep"] == sweep), key=lambda r: r[sweep])
    if len(pts) > 1:
      print(
          f"ratio overhead share {sweep} {pts[0][sweep]} -> {pts[-1][sweep]}: "
          f"{100 * pts[0]['overhead_share']:+.1f} % -> {100 * pts[-1]['overhead_share']:+.1f} %"
      )
  if args.png:
    plot(rows, args.png)
    print(f"plot: {args.png}")
  if args.json:
    write_json(
        args.json,
        dict(machine=machine_line(), runs=args.runs, base=json.loads(base.to_json()), rows=rows),
    )
  return rows


if __name__ == "__main__":
  main()
