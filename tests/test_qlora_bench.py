"""benchmarks/qlora.py's agree part: the model and the modes reach its worker."""

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
