"""scripts/write_shape_gguf.py: the F16 GGUF of a named shape that llama.cpp and monobatch both run
(issue 16's side by side) reads back through monobatch's loader as the dummy shape, and the
tokenizer-only file carries everything the shape's file needs."""

from __future__ import annotations

import subprocess
import sys

import torch

from server_util import ROOT

SCRIPT = ROOT / "scripts" / "write_shape_gguf.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_shape_gguf_reads_back_as_the_dummy_shape(tmp_path, bundled_path):
    from monobatch.loader import load_model
    from monobatch.loader.gguf_file import model_args, open_gguf
    from monobatch.models.shapes import SHAPES
    from monobatch.tokenizer import Tokenizer

    tok = tmp_path / "tok.gguf"
    res = run("--tokenizer-only", "--tokenizer-from", str(bundled_path), "-o", str(tok))
    assert res.returncode == 0, res.stderr
    assert tok.stat().st_size < 4 * 2**20  # small enough to carry to the GPU machine
    assert not open_gguf(tok).tensors  # the loader's reader: gguf-py's, parsed faster (test_loader.py)

    out = tmp_path / "smollm2-1layer.gguf"
    res = run("--shape", "smollm2-135m", "--num-layers", "1", "--tokenizer-from", str(tok), "-o", str(out), "--check")
    assert res.returncode == 0, res.stderr
    assert "reads" in res.stdout and "dummy shape" in res.stdout

    reader = open_gguf(out)
    args = model_args(reader)
    shape = SHAPES["smollm2-135m"]
    for key, value in shape.items():
        want = 1 if key == "num_hidden_layers" else value
        assert getattr(args, key) == want, key
    bundled = open_gguf(bundled_path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert reader.fields[key].contents() == bundled.fields[key].contents(), key
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["token_embd.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" not in types  # tied embeddings

    loaded = load_model(out, device="cpu", progress=False)
    assert loaded.args.num_hidden_layers == 1 and loaded.tokenizer.vocab_size == shape["vocab_size"]
    text = "The capital of France is"
    assert loaded.tokenizer.encode(text) == Tokenizer.from_gguf(bundled).encode(text)


def test_vocabulary_size_mismatch_is_refused(tmp_path, bundled_path):
    res = run("--shape", "tiny", "--tokenizer-from", str(bundled_path), "-o", str(tmp_path / "t.gguf"))
    assert res.returncode != 0 and "tokens, the shape needs 512" in res.stderr


def test_gemma3_shape_layout_is_what_the_loader_reads():
    """The gemma3-1b shape is written as llama.cpp's ``gemma3`` architecture: the tensors of its
    layout are exactly the weights of monobatch's Gemma 3 forward (the four block norms and the q/k
    norms included; q/k/v and gate/up fused from their pieces), and its args are the dummy shape's
    (the 1.3 GB file itself is written and ``--check``-ed on the GPU machine)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import write_shape_gguf as w

    from monobatch.loader.gguf_file import hf_name
    from monobatch.models.layers import PACKED
    from monobatch.models.registry import family

    args = w.shape_args("gemma3-1b", num_layers=6)
    assert w.ARCHES[args.model_type] == "gemma3" and args.layer_windows() == (512,) * 5 + (0,)
    with torch.device("meta"):
        want = {n.removesuffix(".weight") for n, _ in family(args.model_type).Model(args).named_parameters()}
    got = set()
    for name, _, _ in w.tensor_layout(args):
        hf = hf_name(name, args.model_type)
        assert hf is not None, name
        for suffix, (fused, _) in PACKED.items():
            hf = hf.replace(suffix + ".", fused + ".")
        got.add(hf.removesuffix(".weight"))
    assert got == want
