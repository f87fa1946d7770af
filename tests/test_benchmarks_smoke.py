"""Smoke tests: each benchmark script starts, finishes on a tiny config and prints its ratio lines.

Not timed tests: no threshold on any time. What is checked is that every framework's worker ran
its steps, that the reported quantities are consistent (tokens/s = tokens / median time, ratios
equal the quotients of the reported figures), and that the outputs (JSON, PNG, table) are written.
To stay cheap, each script runs end to end once, on the smallest shapes (:data:`TINY`), with
XLA's cheapest compile; logic that needs several runs (the scaling sweeps) is checked with a stub.
"""

import dataclasses
import json
import re

import optax
import pytest

from benchmarks import common, gpu_train_step, scaling, train_step
from benchmarks.common import BenchConfig, interleave, paired_ratio
from tests.helpers.bench_smoke import TINY, fast_xla  # noqa: F401 (autouse)
from tests.helpers.tiny_llama import tiny_llama_config

# One decoder layer where a script's figures do not depend on the layer count (the stacked layout
# of two layers is run by the train_step test and by tests/test_memory_smoke.py).
TINY_1L = TINY[:2] + ["--layers", "1"] + TINY[4:]
TINY_LORA_PARAMS = 1 * 5 * (64 + 64) * 4  # layers x (q, k, v, up, down: in + out) x rank


def test_train_step_on_a_pretrained_model_runs_every_framework_and_prints_ratios(tmp_path, capsys):
  import torch
  import transformers

  torch.manual_seed(0)
  hf = tiny_llama_config(  # every weight 64 x 64; grouped-query attention, as in SmolLM2
      64,
      hidden_size=64,
      intermediate_size=64,
      max_position_embeddings=2048,
      rms_norm_eps=1e-6,
      pad_token_id=None,
      tie_word_embeddings=True,
  )
  transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "model")
  out_json = tmp_path / "train_step.json"
  res = train_step.main(
      ["--model", str(tmp_path / "model"), "--batch", "2", "--seq", "16", "--rank", "4"]
      + ["--frameworks", "jax-adamw,jax-anlr,torch-eager", "--runs", "2", "--warmup", "1"]
      + ["--settle", "1", "--block", "2", "--json", str(out_json)]
  )
  printed = capsys.readouterr().out
  assert set(res["frameworks"]) == {"jax-adamw", "jax-anlr", "torch-eager"}, res["failed"]
  assert (res["config"]["hidden"], res["config"]["heads"]) == (64, 4)  # from the model's config
  for name, fw in res["frameworks"].items():
    assert len(fw["times_ms"]) == 2 and all(t > 0 for t in fw["times_ms"]), name
    assert len(fw["block_first_ms"]) == 2, name  # each turn's first step, left out
    assert len(fw["settle_ms"]) == 2, name  # the untimed round (one block) is kept apart
    assert fw["tokens_per_s"] == pytest.approx(2 * 16 / (fw["median_ms"] / 1e3)), name
    assert fw["steady_peak_rss_mib"] > 0 and fw["peak_rss_mib"] >= fw["steady_peak_rss_mib"] - 1
    assert fw["first_step_s"] > 0, name
  # The same LoRA on the same shapes in JAX and PEFT: 2 layers x (q, up, down: 64 + 64; k, v:
  # 64 + 32, 2 of the 4 heads for keys and values) x rank 4.
  expected = 2 * (3 * 128 + 2 * 96) * 4
  assert {fw["lora_params"] for fw in res["frameworks"].values()} == {expected}
  a, b = res["frameworks"]["jax-adamw"], res["frameworks"]["jax-anlr"]
  assert 0 < a["xla"]["peak_bytes"] and 0 < b["xla"]["peak_bytes"]
  match = re.search(r"ratio step time jax-anlr / jax-adamw: ([0-9.]+)", printed)
  assert match and float(match.group(1)) == pytest.approx(b["median_ms"] / a["median_ms"], abs=1e-3)
  paired = re.search(r"jax-anlr / jax-adamw, median of paired runs: ([0-9.]+)", printed)
  ratios = [y / x for x, y in zip(a["times_ms"], b["times_ms"])]
  assert paired and float(paired.group(1)) == pytest.approx(sum(ratios) / 2, abs=1e-3)
  assert re.search(r"ratio tokens/s jax-adamw / torch-eager: [0-9.]+", printed)
  assert json.loads(out_json.read_text())["config"]["rank"] == 4


def test_train_step_rejects_unknown_framework():
  with pytest.raises(ValueError, match="--frameworks"):
    train_step.main(TINY + ["--frameworks", "jax-adamw,mxnet"])


def test_bench_config_names_bad_field():
  with pytest.raises(ValueError, match="BenchConfig.heads"):
    BenchConfig(hidden=64, heads=5)
  with pytest.raises(ValueError, match="BenchConfig.targets"):
    BenchConfig(targets=("q_proj", "qkv"))
  with pytest.raises(ValueError, match="BenchConfig.torch_autocast"):
    BenchConfig(torch_autocast="bf16")
  with pytest.raises(ValueError, match="BenchConfig.matmul_dtype"):
    BenchConfig(matmul_dtype="float16")


def test_torch_step_autocasts_to_the_gemm_dtype_unless_turned_off():
  """PyTorch's first loss: float32 without autocast, bfloat16 GEMMs under `matmul_dtype` (as JAX
  computes), float32 again with `torch_autocast='off'`."""
  from benchmarks.common import build_torch_step

  tiny = dict(hidden=64, layers=2, heads=4, ffn=64, vocab=64, batch=2, seq=16, rank=4)
  losses = {}
  for name, extra in (
      ("f32", {}),
      ("autocast", {"matmul_dtype": "bfloat16"}),
      ("off", {"matmul_dtype": "bfloat16", "torch_autocast": "off"}),
  ):
    step, _ = build_torch_step(BenchConfig(**tiny, **extra), False)
    losses[name] = float(step())
  assert losses["off"] == losses["f32"]
  assert losses["autocast"] != losses["f32"]


def test_scaling_measures_a_point_and_writes_plot_and_table(tmp_path, capsys):
  png, out_json = tmp_path / "scaling.png", tmp_path / "scaling.json"
  # Base at width 64 as width_config builds it (1 head, FFN 176): each sweep's point is the base.
  base = TINY_1L[:4] + ["--heads", "1", "--ffn", "176"] + TINY_1L[8:]
  rows = scaling.main(
      base
      + ["--ranks", "4", "--seqs", "16", "--widths", "64", "--runs", "2", "--warmup", "1"]
      + ["--png", str(png), "--json", str(out_json)]
  )
  printed = capsys.readouterr().out
  assert [r["sweep"] for r in rows] == ["rank", "seq", "hidden"]
  r = rows[0]
  assert rows[1:] == [dict(r, sweep="seq"), dict(r, sweep="hidden")]  # measured once
  assert r["time_ratio"] == pytest.approx(r["anlr_ms"] / r["adamw_ms"])
  assert r["overhead_share"] == pytest.approx(1 - 1 / r["paired_ratio"])
  assert r["paired_ratio"] > 0 and r["adamw_xla_mib"] > 0 and r["anlr_rss_mib"] > 0
  assert r["lora_params"] == 1 * 4 * (3 * (64 + 64) + 2 * (64 + 176))  # q, k, v; up, down
  assert printed.count("\n| ") == 4  # header and three rows
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert len(json.loads(out_json.read_text())["rows"]) == 3


def test_scaling_sweeps_measure_each_config_once(monkeypatch, capsys):
  measured = []

  def measure(cfg, runs, warmup):
    measured.append((cfg.hidden, cfg.seq, cfg.rank))
    ratio = 1 + cfg.rank / 100
    return dict(
        **{k: getattr(cfg, k) for k in ("hidden", "ffn", "heads", "seq", "rank")},
        lora_params=cfg.rank,
        adamw_ms=10.0,
        anlr_ms=10.0 * ratio,
        time_ratio=ratio,
        paired_ratio=ratio,
        overhead_share=1 - 1 / ratio,
        adamw_xla_mib=1.0,
        anlr_xla_mib=1.0,
        xla_ratio=1.0,
        adamw_rss_mib=2.0,
        anlr_rss_mib=2.0,
        rss_ratio=1.0,
    )

  monkeypatch.setattr(scaling, "measure", measure)
  base = TINY[:4] + ["--heads", "1", "--ffn", "176"] + TINY[8:]
  rows = scaling.main(base + ["--ranks", "2,4", "--seqs", "16,32", "--widths", "64,128"])
  printed = capsys.readouterr().out
  assert [(r["sweep"], r["rank"], r["seq"], r["hidden"]) for r in rows] == [
      ("rank", 2, 16, 64),
      ("rank", 4, 16, 64),
      ("seq", 4, 16, 64),
      ("seq", 4, 32, 64),
      ("hidden", 4, 16, 64),
      ("hidden", 4, 16, 128),
  ]
  # The base config (r 4, seq 16, d 64) appears in three sweeps and is measured once.
  assert measured == [(64, 16, 2), (64, 16, 4), (64, 32, 4), (128, 16, 4)]
  assert "ratio overhead share rank 2 -> 4: +2.0 % -> +3.8 %" in printed
  assert "ratio overhead share seq 16 -> 32" in printed and "hidden 64 -> 128" in printed
  assert printed.count("\n| ") == 7  # header and six rows


def test_scaling_width_config_and_bad_lists():
  cfg = scaling.width_config(BenchConfig(), 1024)
  assert (cfg.hidden, cfg.ffn, cfg.heads) == (1024, 2752, 16)
  assert scaling.width_config(BenchConfig(), 512).ffn == 1376
  with pytest.raises(ValueError, match="--widths"):
    scaling.width_config(BenchConfig(), 100)
  with pytest.raises(ValueError, match="--ranks"):
    scaling.main(["--ranks", "4,x"])


def test_gpu_train_step_flops_count_matches_the_model_parameter_count():
  from anlr_jax.models.config import ModelConfig

  cfg = gpu_train_step.LLAMA2_7B
  fl = gpu_train_step.flops_per_token(cfg)
  ref = ModelConfig.preset("llama2_7b")
  norms = (2 * ref.num_hidden_layers + 1) * ref.hidden_size
  # Every matmul weight = all parameters - embedding table - RMSNorm weights (lm_head included).
  assert fl["matmul_weights"] == ref.num_params() - ref.vocab_size * ref.hidden_size - norms
  assert fl["lora_step"] < fl["palm_6n"]  # no weight gradients of the frozen matrices


def test_gpu_train_step_runs_on_cpu_and_reports_consistent_figures(tmp_path, capsys):
  out_json = tmp_path / "gpu.json"
  args = TINY_1L + ["--dtype", "float32", "--attention", "xla", "--runs", "2", "--warmup", "1"]
  summary = gpu_train_step.main(
      args
      + ["--frameworks", "jax,torch", "--windows", "1,2", "--json", str(out_json), "--profile"]
      + ["--batch_modules", "true"]  # the accelerator's AnLR graph, built on the CPU
  )
  jax_part, torch_part = summary["results"]["jax"], summary["results"]["torch"]
  assert "error" not in jax_part and "error" not in torch_part, summary["report"]
  a, b, t = jax_part["jax-adamw"], jax_part["jax-anlr"], torch_part["torch"]
  for r in (a, b, t):
    assert len(r["step_ms"]) == 2 and all(x > 0 for x in r["step_ms"])
    assert r["tokens_per_s"] == pytest.approx(2 * 16 / (r["median_ms"] / 1e3))
  assert set(a["step_ms_by_window"]) == {"1", "2"}
  assert jax_part["batch_modules"] is True
  assert jax_part["lora_params"] == t["lora_params"] == TINY_LORA_PARAMS
  ratios = [y / x for x, y in zip(a["step_ms"], b["step_ms"])]  # window 2, the last one
  assert jax_part["anlr_over_adamw_paired"] == pytest.approx(sum(ratios) / 2)
  printed = capsys.readouterr().out
  match = re.search(r"AnLR / AdamW: step time ([0-9.]+)", printed)
  assert match and float(match.group(1)) == pytest.approx(b["median_ms"] / a["median_ms"], abs=1e-3)
  assert re.search(r"tokens/s jax-adamw / torch: [0-9.]+", printed)
  assert json.loads(out_json.read_text())["config"]["seq"] == 16
  # --profile: the kernels AnLR adds, by kind (here XLA CPU's thread-pool kernels).
  diff = jax_part["profile_kind_diff"]
  assert diff and sum(count for _, count, _ in diff) > 0
  png = gpu_train_step.plot(str(out_json), str(tmp_path / "gpu.png"))
  assert (tmp_path / "gpu.png").stat().st_size > 5000 and png.endswith("gpu.png")


def test_gpu_train_step_falls_back_from_cudnn_only_when_cudnn_refuses(monkeypatch):
  """A cuDNN refusal retries with XLA attention; a missing package (an incomplete install) stops
  the run instead of timing another attention under the same name."""

  def missing(cfg, attention, *args):
    if attention == "cudnn":
      raise ModuleNotFoundError("No module named 'gguf'")
    raise AssertionError(f"retried with attention={attention!r}")

  monkeypatch.setattr(gpu_train_step, "_build_jax_steps", missing)
  cfg = BenchConfig(hidden=32, layers=1, heads=2, ffn=64, vocab=64, batch=1, seq=8, rank=2)
  with pytest.raises(ModuleNotFoundError, match="gguf"):
    gpu_train_step.jax_worker(cfg, "cudnn", runs=1, warmup=0)


def test_bench_config_loss_chunk_reaches_the_train_step(monkeypatch):
  import anlr_jax.train

  seen = {}

  def capture(graphdef, tx, **kwargs):
    seen.update(kwargs)
    raise KeyboardInterrupt  # stop before compiling

  monkeypatch.setattr(anlr_jax.train, "make_train_step", capture)
  cfg = BenchConfig(hidden=32, layers=1, heads=2, ffn=64, vocab=64, batch=1, seq=8, rank=2)
  for chunk in (0, 4):
    with pytest.raises(KeyboardInterrupt):
      common.JaxStep(dataclasses.replace(cfg, loss_chunk=chunk, remat="full"), optax.adamw(1e-3))
    assert seen["loss_chunk"] == chunk and seen["remat"] == "full"
  with pytest.raises(ValueError, match="loss_chunk=-1"):
    BenchConfig(loss_chunk=-1)


def test_profile_reads_kernels_from_xla_op_lines_and_gpu_compute_streams():
  is_op = gpu_train_step._is_device_op_line
  assert is_op("/device:GPU:0", "Stream #14(Memset,Compute)")  # a CUDA trace's kernels
  assert is_op("/device:TPU:0", "XLA Ops")
  assert not is_op("/device:GPU:0", "Stream #15(MemcpyH2D)")
  assert not is_op("/host:CPU", "XLAEigen")


def test_kernel_kinds_drop_numeric_suffixes_and_diff_by_count():
  assert gpu_train_step.kernel_kind("loop_add_fusion_12") == "loop_add_fusion"
  assert gpu_train_step.kernel_kind("input_reduce_fusion.3_1") == "input_reduce_fusion"
  assert gpu_train_step.kernel_kind("nvjet_sm90_tst_256x128") == "nvjet_sm90_tst_256x128"
  base = {"a": (4.0, 1.0), "b": (1.0, 0.5)}
  other = {"a": (4.0, 1.2), "b": (3.0, 0.9), "c": (5.0, 0.1)}
  assert gpu_train_step.kernel_kind_diff(base, other) == [
      ("c", 5.0, 0.1),
      ("b", 2.0, pytest.approx(0.4)),
  ]


def test_memory_phases_reports_every_phase_for_both_optimizers(tmp_path):
  from benchmarks import memory_phases

  out_json = tmp_path / "mem.json"
  out = memory_phases.main(TINY_1L + ["--steps", "1", "--attribute", "--json", str(out_json)])
  for opt in memory_phases.OPTIMIZERS:
    r = out["results"][opt]
    assert set(r["phases"]) == set(memory_phases.PHASES)
    assert all(p["rss"] > 0 for p in r["phases"].values())
    assert r["xla_mib"] > 0 and r["serialized_mib"] > 0 and r["hlo_lines"] > 0
  # AnLR's step has more HLO than AdamW's (the per-rank statistics); the report names the ratios.
  assert out["results"]["anlr"]["hlo_lines"] > out["results"]["adamw"]["hlo_lines"]
  assert (
      "step peak RSS" in out["report"] and json.loads(out_json.read_text())["config"]["rank"] == 4
  )
  # --attribute: memray saw the compiler's heap; the executable keeps the HLO module it compiled,
  # more of it for AnLR's larger HLO.
  held = {opt: out["results"][opt]["held_after_compile"] for opt in memory_phases.OPTIMIZERS}
  assert held["adamw"]["HLO module"] > 0
  assert held["anlr"]["HLO module"] > held["adamw"]["HLO module"]
  assert all(out["results"][o]["compile_peak_heap"] > sum(held[o].values()) for o in held)
  assert "heap held after compiling" in out["report"]


def test_memory_phases_charges_native_frames_to_components():
  from benchmarks.memory_phases import component

  assert component(["malloc", "xla::HloInstruction::HloInstruction(...)", "xla::Thunk"]) == (
      "HLO module"
  )
  # innermost match wins; the buffer assignment is checked before the HLO classes it points to
  assert component(["xla::HloDataflowAnalysis::NewHloValue(...)"]) == "buffer assignment"
  assert component(["operator new", "ynn_runtime::build()", "xla::cpu::YnnFusionThunk::Run"]) == (
      "YNNPACK runtimes"
  )
  assert component(["malloc", "PyObject_Malloc"]) == "other"


def test_memory_phases_repeated_summary_gives_medians_and_ranges_against_adamw():
  from benchmarks.memory_phases import CONTROL, repeated_summary

  def result(peak, rss, inuse):
    return {"step_peak_rss": peak, "phases": {"steps": {"rss": rss, "inuse": inuse}}}

  rounds = [
      {"adamw": result(100, 50, 20), "anlr": result(102, 53, 21), CONTROL: result(99, 49, 20)},
      {"adamw": result(100, 50, 20), "anlr": result(101, 51, 21), CONTROL: result(101, 52, 20)},
      {"adamw": result(200, 50, 20), "anlr": result(202, 55, 22), CONTROL: result(200, 50, 20)},
  ]
  text, table = repeated_summary(rounds)
  assert table["anlr"]["step_peak_rss_ratio"] == {"median": 1.01, "min": 1.01, "max": 1.02}
  assert table["anlr"]["rss_diff_mib"] == {"median": 3, "min": 1, "max": 5}
  assert table["anlr"]["live_heap_diff_mib"] == {"median": 1, "min": 1, "max": 2}
  assert table[CONTROL]["step_peak_rss_ratio"] == {"median": 1.0, "min": 0.99, "max": 1.01}
  assert "over 3 rounds" in text and "adamw-control 1.0000 [0.9900, 1.0100]" in text


def test_nonfinite_guard_times_both_steps_and_prints_the_ratio(tmp_path, capsys):
  from benchmarks import nonfinite_guard

  res = nonfinite_guard.main(TINY_1L + ["--rounds", "3", "--out", str(tmp_path / "guard.json")])
  printed = capsys.readouterr().out
  assert set(res["median_ms"]) == {"guarded", "unguarded"}
  assert res["ratio_guarded_over_unguarded"] == pytest.approx(
      res["median_ms"]["guarded"] / res["median_ms"]["unguarded"]
  )
  assert re.search(r"ratio \d\.\d{4} \(paired \d\.\d{4}\), 3 rounds", printed)
  assert json.loads((tmp_path / "guard.json").read_text())["rounds"] == 3


def test_optimizer_overhead_times_both_optimizers_and_counts_their_state(tmp_path, capsys):
  from benchmarks import optimizer_overhead

  out_json = tmp_path / "opt.json"
  res = optimizer_overhead.main(
      ["--layers", "1", "--rank", "2", "--runs", "2", "--warmup", "1", "--window", "2"]
      + ["--stacked", "--unbatched", "--json", str(out_json)]
  )
  printed = capsys.readouterr().out
  assert res["time_ratio"] == pytest.approx(res["anlr_ms"] / res["adamw_ms"])
  assert res["unbatched_time_ratio"] == pytest.approx(res["anlr_unbatched_ms"] / res["adamw_ms"])
  assert res["lora_params"] == 2 * (3 * 8192 + 2 * 15104)  # 1 layer x r 2 x (q, k, v; up, down)
  assert res["anlr_state_bytes"] > res["adamw_state_bytes"] and res["extra_state_pct"] < 1
  assert re.search(
      r"median of 2 interleaved runs: adamw [0-9.]+ ms, anlr [0-9.]+ ms, ratio", printed
  )
  assert "anlr(batch_modules=False)" in printed and "optimizer state: adamw" in printed
  assert json.loads(out_json.read_text())["window"] == 2


def test_interleave_takes_turns_and_keeps_the_untimed_rounds_apart():
  calls = []

  def step(name, seconds):
    def run():
      calls.append(name)
      return seconds

    return run

  steps = {"a": step("a", 1.0), "b": step("b", 2.0), "c": step("c", 4.0)}
  timings = interleave(steps, 3, warmup=1, settle=2, seed=3)
  assert calls[:3] == ["a", "b", "c"]  # the warmup round, in the given order
  rounds = [calls[i : i + 3] for i in range(3, len(calls), 3)]
  assert len(rounds) == 5 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
  assert len({tuple(r) for r in rounds}) > 1  # shuffled round by round
  assert {k: len(v) for k, v in timings.times.items()} == {"a": 3, "b": 3, "c": 3}
  assert {k: len(v) for k, v in timings.settle.items()} == {"a": 2, "b": 2, "c": 2}
  assert timings.median("c") == 4.0 and timings.paired("b", "a") == 2.0
  calls.clear()
  interleave(steps, 2, shuffle=False)
  assert calls == ["a", "b", "c"] * 2
  assert paired_ratio([2.0, 3.0, 10.0], [1.0, 1.0, 1.0]) == 3.0
  # blocks: each turn is 3 back-to-back calls; the first of each timed turn is kept apart
  counter = iter(range(1000))
  steps = {"a": lambda: next(counter), "b": lambda: next(counter)}
  timings = interleave(steps, 2, settle=1, shuffle=False, block=3)
  assert timings.settle == {"a": [0, 1, 2], "b": [3, 4, 5]}
  assert timings.block_first == {"a": [6, 12], "b": [9, 15]}
  assert timings.times == {"a": [7, 8, 13, 14], "b": [10, 11, 16, 17]}
  with pytest.raises(ValueError, match="block=0"):
    interleave(steps, 1, block=0)


def test_cpu_rates_reports_every_element_type_and_row_count_consistently(tmp_path, capsys):
  from benchmarks import cpu_rates

  out = tmp_path / "rates.json"
  assert (
      cpu_rates.main(["--size", "64", "--layers", "2", "--repeats", "1", "--json", str(out)]) == 0
  )
  record = json.loads(out.read_text())
  assert set(record["square_gflops"]) == {"float32", "bfloat16", "int8"}
  assert all(rate > 0 for rate in record["square_gflops"].values())
  rows = record["rows"]
  assert [r["rows"] for r in rows] == [1, 2, 4, 8, 16]
  weights = 2 * 2 * 576 * 1536
  for r in rows:
    assert r["vs_one_row"] == pytest.approx(r["ms"] / rows[0]["ms"])
    assert r["gflops"] == pytest.approx(2 * r["rows"] * weights / r["ms"] / 1e6)
    assert r["weights_gb_per_s"] == pytest.approx(4 * weights / r["ms"] / 1e6)
  assert "x one row" in capsys.readouterr().out
