"""Run config: YAML loading, dotted overrides, validation errors naming key and allowed values."""

import dataclasses
import pathlib

import pytest
import yaml

from anlr_jax.app import config as cfg
from anlr_jax.app import paths
from anlr_jax.settings import field_help, rule_of
from anlr_jax.methods import METHOD_NAMES
from anlr_jax.train import TrainerConfig

REPO = pathlib.Path(__file__).resolve().parents[1]


def _write(tmp_path, text, name="run.yaml"):
  path = tmp_path / name
  path.write_text(text)
  return path


def test_yaml_and_overrides_give_typed_values(tmp_path):
  path = _write(
      tmp_path,
      """
method: lora
model: {path: models/x, dtype: bfloat16}
lora: {rank: 8, alpha: 16}
trainer: {learning_rate: 3.0e-4, epochs: 1, global_batch: 4}
eval: {tasks: {boolq: data/boolq.json}}
""",
  )
  c = cfg.load_config(
      path,
      [
          "lora.rank=16",
          "method=anlr+dora",
          "trainer.learning_rate=2e-4",
          "eval.tasks.piqa=data/piqa.json",
          "trainer.clip_norm=null",
          "lora.targets=q_proj,v_proj",
          "compare=[lora, anlr]",
          "anlr.kappa=4",
          "eval.include_base=true",
          "trainer.steps=3",
      ],
  )
  assert c.method == "anlr+dora" and c.compare == ["lora", "anlr"]
  assert c.methods() == ["lora", "anlr"]
  assert c.lora.rank == 16 and isinstance(c.lora.rank, int)
  assert c.lora.alpha == 16.0 and isinstance(c.lora.alpha, float)
  assert c.lora.targets == ["q_proj", "v_proj"]
  assert isinstance(c.trainer, TrainerConfig)
  assert c.trainer.learning_rate == 2e-4 and c.trainer.clip_norm is None and c.trainer.steps == 3
  assert c.trainer.global_batch == 4 and c.trainer.epochs == 1.0
  assert c.eval.tasks == {"boolq": "data/boolq.json", "piqa": "data/piqa.json"}
  assert c.eval.include_base is True and c.anlr.kappa == 4.0 and c.model.dtype == "bfloat16"


def test_saved_config_round_trips(tmp_path):
  c = cfg.load_config(None, ["lora.rank=4", "method=pissa", "trainer.steps=7", "seed=3"])
  cfg.save_config(c, tmp_path / "config.yaml")
  again = cfg.load_config(tmp_path / "config.yaml")
  assert dataclasses.asdict(again) == dataclasses.asdict(c)
  assert "seed" not in yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]


@pytest.mark.parametrize(
    "override, pattern",
    [
        (
            ["lora.rnk=3"],
            r"unknown key 'lora.rnk'; allowed keys in 'lora': rank, alpha, dropout, targets",
        ),
        (
            ["bogus=1"],
            r"unknown key 'bogus'; allowed top-level keys: method, compare, run_dir, seed, compile_cache, model",
        ),
        (["optim.lr=1"], r"unknown section 'optim'"),
        (["lora.rank=abc"], r"lora.rank: expected int, got 'abc'"),
        (["lora.rank=2.5"], r"lora.rank: expected int, got '2.5'"),
        (["trainer.learning_rate=fast"], r"trainer.learning_rate: expected float, got 'fast'"),
        (["eval.include_base=maybe"], r"eval.include_base: expected bool"),
        (["method=qlora"], r"method: 'qlora' is not allowed; must be one of \['lora', 'rslora'"),
        (["compare=[lora,bad]"], r"compare: 'bad' is not allowed; must be one of \['lora'"),
        (
            ["model.dtype=int8"],
            r"model.dtype: 'int8' is not allowed; must be one of \['float32', 'bfloat16'",
        ),
        (
            ["trainer.remat=yes"],
            r"trainer.remat: 'yes' is not allowed; must be one of \['none', 'full', 'dots'\]",
        ),
        (["data.format=csv"], r"data.format: 'csv' is not allowed; must be one of \['messages'"),
        (
            ["eval.tasks.mmlu=x.json"],
            r"eval.tasks: 'mmlu' is not allowed; must be one of \['boolq'",
        ),
        (["lora.dropout=1.0"], r"lora.dropout: 1.0 is not allowed; must be >= 0 and < 1"),
        (["anlr.kappa=1"], r"anlr.kappa: 1.0 is not allowed; must be > 1"),
        (["anlr.rho=1"], r"anlr.rho: 1.0 is not allowed; must be >= 0 and < 1"),
        (["lora.rank=0"], r"lora.rank: 0 is not allowed; must be >= 1"),
        (["trainer.global_batch=0"], r"trainer.global_batch: 0 is not allowed; must be >= 1"),
        (
            ["trainer.global_batch=6", "trainer.micro_batches=4"],
            r"trainer.global_batch=6 is not divisible",
        ),
        (["trainer.seed=1"], r"trainer.seed is set by the top-level key 'seed'"),
        (["trainer.optimizer=adamw"], r"unknown key 'trainer.optimizer'"),
        (["lora=3"], r"'lora' is a section; set one of its keys \(rank, alpha, dropout, targets\)"),
        (["rank"], r"override 'rank' is not key=value"),
    ],
)
def test_bad_overrides_name_the_key_and_the_allowed(override, pattern):
  with pytest.raises(cfg.ConfigError, match=pattern):
    cfg.load_config(None, override)


def test_errors_in_a_file_name_the_file(tmp_path):
  path = _write(tmp_path, "lora:\n  rank: 8\n  alhpa: 16\n")
  with pytest.raises(cfg.ConfigError, match=f"{path}: unknown key 'lora.alhpa'"):
    cfg.load_config(path)
  path = _write(tmp_path, "lora: {rank: 8\ntrainer: [\n", "broken.yaml")
  with pytest.raises(cfg.ConfigError, match=f"{path}:\\d+: invalid YAML"):
    cfg.load_config(path)
  path = _write(tmp_path, "- a\n- b\n", "list.yaml")
  with pytest.raises(cfg.ConfigError, match=f"{path}: expected a mapping"):
    cfg.load_config(path)
  path = _write(tmp_path, "lora: 8\n", "section.yaml")
  with pytest.raises(cfg.ConfigError, match="lora: expected a mapping of keys \\(rank, alpha"):
    cfg.load_config(path)
  with pytest.raises(FileNotFoundError, match="config file not found: .*nope.yaml"):
    cfg.load_config(tmp_path / "nope.yaml")


def test_help_documents_every_key():
  text = cfg.help_text()
  for name, section in cfg.SECTIONS.items():
    for f in dataclasses.fields(section):
      key = f"{name}.{f.name}"
      line = next(l for l in text.splitlines() if l.startswith(f"  {key} ("))
      assert field_help(f) and field_help(f) in line, key
      if rule_of(f) is not None:
        assert f"[{rule_of(f)}]" in line, key
  for key in cfg.TOP_LEVEL:
    assert any(l.startswith(f"  {key} (") for l in text.splitlines())
  assert "anlr+dora" in text and "trainer.learning_rate (float, default 0.0003)" in text


def test_paths_and_run_dir():
  from anlr_jax import assets

  assert paths.resolve_path("asset://quickstart/train.json") == str(
      pathlib.Path(assets.__file__).parent / "quickstart" / "train.json"
  )
  assert paths.resolve_path("data/x.json") == "data/x.json" and paths.resolve_path(None) is None
  assert (
      paths.format_run_dir(
          "runs/{method}-s{seed}-{timestamp}", method="anlr+dora", seed=2, timestamp="T"
      )
      == "runs/anlr_dora-s2-T"
  )
  with pytest.raises(cfg.ConfigError, match="run_dir: .*bad placeholder"):
    paths.format_run_dir("runs/{name}", method="lora", seed=0)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
  if not cfg.read_yaml(path):  # a comment-only note about an unsupported setting
    assert "NOT SUPPORTED" in path.read_text()
    return
  c = cfg.load_config(path)
  assert set(c.methods()) <= set(METHOD_NAMES)
  assert c.model.path and c.data.train


def test_paper_settings_app_b():
  cs = cfg.load_config(REPO / "configs" / "commonsense_llama2_7b.yaml")
  assert (cs.lora.rank, cs.lora.alpha, cs.lora.dropout) == (32, 64.0, 0.05)
  assert (cs.trainer.learning_rate, cs.trainer.global_batch, cs.trainer.epochs) == (1e-4, 16, 3.0)
  assert cs.lora.targets == ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
  assert len(cs.eval.tasks) == 8 and (
      cs.anlr.velocity_weight,
      cs.anlr.snr_weight,
      cs.anlr.kappa,
  ) == (2.0, 1.0, 3.0)
  for name in ("math", "code", "dialogue"):
    c = cfg.load_config(REPO / "configs" / f"{name}_llama2_7b.yaml")
    assert (c.lora.rank, c.lora.alpha, c.trainer.learning_rate, c.trainer.epochs) == (
        8,
        16.0,
        3e-4,
        3.0,
    )
  note = (REPO / "configs" / "visual_llava1_5_7b.yaml").read_text()
  assert "rank: 128" in note and "alpha: 256" in note and "2.0e-4" in note


# ------------------------------------------------------------------ renamed keys, shipped configs
@pytest.mark.parametrize(
    "old, new, value",
    [
        ("trainer.warmup_steps", "trainer.lr_warmup_steps", 7),
        ("anlr.alpha", "anlr.velocity_weight", 1.5),
        ("anlr.beta", "anlr.snr_weight", 0.5),
    ],
)
def test_renamed_keys_still_work_with_a_warning(old, new, value, tmp_path, caplog, monkeypatch):
  import logging

  section, name = old.split(".")
  monkeypatch.setattr(logging.getLogger("anlr_jax"), "propagate", True)  # the CLI turns it off
  with caplog.at_level("WARNING", logger="anlr_jax"):
    config = cfg.load_config(None, [f"{old}={value}"])
    from_file = cfg.load_config(_write(tmp_path, f"{section}:\n  {name}: {value}\n"))
  assert getattr(getattr(config, section), new.split(".")[1]) == value
  assert dataclasses.asdict(from_file) == dataclasses.asdict(config)
  assert f"{old} is renamed {new}" in caplog.text
  with pytest.raises(cfg.ConfigError, match=f"{old} and {new} are the same key"):
    cfg.load_config(None, [f"{old}={value}", f"{new}={value}"])


def test_an_identity_saved_under_an_old_key_matches_the_new_key():
  from anlr_jax.train.trainer import identity_changes

  saved = {"trainer.warmup_steps": 30, "anlr.alpha": 2.0, "anlr.beta": 1.0, "seed": 0}
  now = {"trainer.lr_warmup_steps": 30, "anlr.velocity_weight": 2.0, "anlr.snr_weight": 1.0}
  renamed = cfg.RENAMED_KEYS
  assert identity_changes(saved, {**now, "seed": 0}, renamed=renamed) == []
  assert identity_changes(saved, {**now, "seed": 0, "anlr.snr_weight": 0.0}, renamed=renamed) == [
      "anlr.snr_weight: 1.0 -> 0.0"
  ]


def test_the_anlr_section_maps_to_the_optimizer_arguments():
  import anlr_jax

  section = cfg.load_config(None, ["anlr.velocity_weight=1.5", "anlr.snr_weight=0.25"]).anlr
  assert section.as_kwargs() == dict(alpha=1.5, beta=0.25, kappa=3.0, rho=0.95, warmup_steps=100)
  assert set(section.as_kwargs()) == set(anlr_jax.DEFAULTS)


def test_shipped_configs_are_package_data_and_found_by_name():
  import anlr_jax

  shipped = paths.shipped_configs()
  assert {"quickstart", "commonsense_llama2_7b", "smollm2_135m_math"} <= set(shipped)
  assert all(
      p.parent == pathlib.Path(anlr_jax.__file__).parent / "configs" for p in shipped.values()
  )
  for name in shipped:  # each one loads and validates (paths are not resolved here)
    assert paths.find_config(name) == str(shipped[name])
    assert paths.find_config(f"{name}.yaml") == str(shipped[name])
    cfg.load_config(paths.find_config(name))
    assert paths.config_summary(shipped[name])
  with pytest.raises(FileNotFoundError, match="shipped configs, usable by name: .*quickstart"):
    paths.find_config("commonsense_llama9")


def test_every_setting_has_help_and_its_rule_is_the_check():
  from anlr_jax.settings import ConfigError, Range, check_fields, setting
  from anlr_jax.train import TrainerConfig

  for section in cfg.SECTIONS.values():
    for f in dataclasses.fields(section):
      assert field_help(f), f"{section.__name__}.{f.name} has no help text"
  with pytest.raises(ConfigError, match=r"TrainerConfig.keep: 1 is not allowed; must be >= 2"):
    TrainerConfig(keep=1)

  @dataclasses.dataclass
  class Knobs:
    rate: float = setting(0.5, "a rate", Range(0, 1, hi_open=True))

  check_fields(Knobs())
  with pytest.raises(ConfigError, match=r"knobs.rate: 1.0 is not allowed; must be >= 0 and < 1"):
    check_fields(Knobs(rate=1.0), "knobs.")
  with pytest.raises(ConfigError, match=r"nan is not allowed"):
    check_fields(Knobs(rate=float("nan")), "knobs.")


def test_the_schedule_warms_up_and_decays_within_the_run():
  from anlr_jax.train import TrainerConfig

  schedule = TrainerConfig(learning_rate=1.0, lr_warmup_steps=2).schedule(4)
  assert [float(schedule(t)) for t in range(5)] == [0.0, 0.5, 1.0, 0.5, 0.0]
  cut = TrainerConfig(learning_rate=1.0, lr_warmup_steps=10).schedule(4)  # warmup cut at 4
  assert [float(cut(t)) for t in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_eval_task_aliases_are_stored_under_the_canonical_names(tmp_path):
  load_config, ConfigError = cfg.load_config, cfg.ConfigError
  c = load_config(None, ["eval.tasks.arc_e=a.json", "eval.tasks.SIQA=s.json", "eval.tasks.GSM8K=g"])
  assert c.eval.tasks == {"ARC-Easy": "a.json", "social_i_qa": "s.json", "gsm8k": "g"}
  (tmp_path / "c.yaml").write_text("eval:\n  tasks:\n    obqa: o.json\n    openbookqa: p.json\n")
  with pytest.raises(ConfigError, match=r"c.yaml: eval.tasks: 'obqa' and 'openbookqa' name the"):
    load_config(tmp_path / "c.yaml")


def test_the_trainer_section_adds_the_checkpoint_directory_to_the_library_config():
  from anlr_jax.train import TrainerConfig

  section = cfg.load_config(None, ["trainer.ckpt_dir=ck", "trainer.steps=3"]).trainer
  assert section.ckpt_dir == "ck"
  library = section.trainer_config()
  assert type(library) is TrainerConfig and library.steps == 3
  assert not {"run_dir", "ckpt_dir", "seed"} & {f.name for f in dataclasses.fields(TrainerConfig)}


def test_identity_fields_come_from_the_field_metadata():
  from anlr_jax.settings import identity_of, setting

  @dataclasses.dataclass
  class Section:
    a: int = setting(1, "a", identity=True)
    b: str = setting("x", "b", identity="unless-default")
    c: int = setting(0, "c")

  assert identity_of(Section(), "s.") == {"s.a": 1}
  assert identity_of(Section(b="y", c=2), "s.") == {"s.a": 1, "s.b": "y"}
  with pytest.raises(ValueError, match="identity="):
    setting(0, "d", identity="sometimes")
