"""benchmarks/qlora.py: the agree part's model and modes reach its worker; the linear layers'
bytes leave out a quantised embedding table; the train part's figures reach ``--out``."""

from benchmarks import common, qlora


def test_the_agree_part_passes_its_model_and_modes_to_the_worker(monkeypatch, capsys):
  seen = []

  def run_worker(argv, env=None):
    seen.append(argv)
    return {"nf4": {"top1_agreement": 0.5, "identical_continuations": 1, "prompts": 2}}

  monkeypatch.setattr(common, "run_worker", run_worker)
  assert qlora.main(
      ["--parts", "agree", "--modes", "none,nf4", "--agree_model", "m/judge.gguf"]
  ) in (0, None)
  (argv,) = seen
  assert argv[argv.index("--agree_model") + 1] == "m/judge.gguf"
  assert argv[argv.index("--modes") + 1] == "none,nf4"
  assert "agreement with float32, judge.gguf, 2 prompts" in capsys.readouterr().out


def test_linear_bytes_leave_out_the_quantised_table():
  import numpy as np

  layer = {"codes": np.zeros((32, 8), np.uint8), "scales": np.zeros((1, 8), np.uint8)}
  frozen = {
      "model": {
          "embed_tokens": {"codes": np.zeros((32, 100), np.uint8)},
          "layers": {0: {"mlp": {"up_proj": layer}}},
      }
  }
  assert qlora._linear_bytes(frozen) == 32 * 8 + 8


def test_the_train_part_writes_its_figures_to_out(monkeypatch, tmp_path):
  import json

  info = {
      "base_bytes": 2**20,
      "linear_bytes": 2**19,
      "rss_after_warmup_mib": 900.0,
      "steady_peak_rss_mib": 1000.0,
      "rss_built_mib": 800.0,
      "xla": {"temp_size_in_bytes": 2**20},
  }

  class Worker:

    def __init__(self, name, argv, env=None):
      self.name = name

    def step(self):
      return 1.0

    def finish(self):
      return {**info, "mode": self.name}

    def kill(self):
      pass

  def interleave(steps, rounds, settle, seed):
    return common.Timings(times={m: [1.0 + i] * rounds for i, m in enumerate(steps)}, settle={})

  monkeypatch.setattr(common, "Worker", Worker)
  monkeypatch.setattr(common, "interleave", interleave)
  out = tmp_path / "train.json"
  argv = ["--parts", "train", "--modes", "none,nf4", "--rounds", "2", "--out", str(out)]
  assert qlora.main(argv) in (0, None)
  train = json.loads(out.read_text())["train"]
  assert train["batch"] == 4 and set(train["modes"]) == {"none", "nf4"}
  assert train["modes"]["nf4"]["step_times"] == [2.0, 2.0]
  assert train["modes"]["none"]["steady_peak_rss_mib"] == 1000.0
