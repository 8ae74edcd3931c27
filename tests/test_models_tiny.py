"""Every supported architecture and RoPE variant against HF transformers on tiny random models.

transformers builds and saves each model (safetensors); our loader reads it back and our
forward must give HF's logits. The llama model is also written as GGUF the way llama.cpp's
converter does (Q/K rows permuted), in several weight types, to test the GGUF path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from monobatch.batch import StepBatch  # noqa: E402
from monobatch.kv.dense import DenseKv  # noqa: E402
from monobatch.loader import gguf_file, hf_dir  # noqa: E402
from monobatch.quant.formats import PACKED_TYPES  # noqa: E402
from monobatch.quant.packed import PackedWeight  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama-llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}}),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    # Gemma 3: a local layer (window 8, crossed by the 40-token prompt in both chunks) and a global
    # one with linear RoPE scaling, query_pre_attn_scalar != head_dim, (1 + w) norms, GeGLU
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 12, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}}),
}


def our_logits(model, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits through our forward, in two chunks (exercises the KV path)."""
    a = model.args
    kv = DenseKv(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, a.max_position_embeddings,
                 torch.float32, torch.device("cpu"), windows=a.layer_windows())
    rows = []
    cut = len(ids) // 2
    for seq_chunk, pos in ((ids[:cut], 0), (ids[cut:], cut)):
        batch = StepBatch.build([(0, seq_chunk, pos, True)])
        kv.prepare(batch)
        rows.append(model(batch, kv))
        kv.commit(batch)
    return torch.cat(rows)


def make_hf(case: str, tmp_path):
    config_cls, model_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    if case == "qwen2":  # random init leaves biases at zero; make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    for name, p in model.named_parameters():  # norms away from 1 so they are tested too
        if "norm" in name:
            p.data.normal_(1.0, 0.2)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_hf_folder_matches_transformers(case, tmp_path):
    hf = make_hf(case, tmp_path)
    model = hf_dir.load_hf_model(tmp_path, torch.device("cpu"), torch.float32, progress=False)
    ids = [int(x) for x in torch.randint(0, BASE["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = our_logits(model, ids)
    cut = len(ids) // 2
    torch.testing.assert_close(ours, ref[[cut - 1, len(ids) - 1]], atol=1e-4, rtol=1e-4)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's Q/K permutation (rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(hf, path, qtype) -> dict[str, np.ndarray]:
    """Write ``hf`` as a llama GGUF with 2-D weights in ``qtype``; returns what each weight
    dequantizes to (HF layout), i.e. the weights the loaded model must hold."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    expected = {}
    for name, t in hf.state_dict().items():
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
            if module == "self_attn.q_proj":
                arr = permute(arr, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                arr = permute(arr, cfg.num_key_value_heads)
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(arr, qtype)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qtype)
            deq = gguf.quants.dequantize(q, qtype).reshape(arr.shape)
        else:
            w.add_tensor(gname, arr)
            deq = arr
        if ".attn_q." in gname:
            deq = gguf_file.unpermute_qk(deq, cfg.num_attention_heads)
        elif ".attn_k." in gname:
            deq = gguf_file.unpermute_qk(deq, cfg.num_key_value_heads)
        expected[name] = deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_gguf_f32_matches_transformers(tmp_path):
    """The Q/K un-permutation restores HF's layout: a float32 GGUF gives HF's logits."""
    hf = make_hf("llama", tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", gguf.GGMLQuantizationType.F32)
    model = gguf_file.load_gguf_model(gguf_file.open_gguf(tmp_path / "m.gguf"), torch.device("cpu"), torch.float32, progress=False)
    ids = list(range(3, 43))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(our_logits(model, ids), ref[[19, 39]], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_weight_types_load_exactly(qtype, tmp_path):
    """Each weight type gguf-py can write loads to exactly gguf-py's dequantized values (packed
    types held packed, compared once dequantized; Q5_1 has no packed layout)."""
    hf = make_hf("llama", tmp_path / "hf")
    expected = write_gguf(hf, tmp_path / "m.gguf", gguf.GGMLQuantizationType[qtype])
    reader = gguf_file.open_gguf(tmp_path / "m.gguf")
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {qtype}
    model = gguf_file.load_gguf_model(reader, torch.device("cpu"), torch.float32, progress=False)
    layer = model.layers[0]
    packed = qtype in {t.name for t in PACKED_TYPES}
    assert layer.self_attn.qkv_proj.packed == packed and isinstance(model.embed_tokens, PackedWeight) == packed

    def dense(w):
        return (w.dequantize() if isinstance(w, PackedWeight) else w).numpy()

    q, kv = 64, 32
    qkv = dense(layer.self_attn.qkv_proj.weight)
    np.testing.assert_array_equal(qkv[:q], expected["model.layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(qkv[q:q + kv], expected["model.layers.0.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(dense(model.embed_tokens), expected["model.embed_tokens.weight"])
    np.testing.assert_array_equal(dense(layer.mlp.down_proj.weight), expected["model.layers.0.mlp.down_proj.weight"])


def test_hf_folder_end_to_end_with_padded_vocab(tmp_path):
    """An HF folder whose embedding has more rows (128) than the tokenizer has ids (100), as HF
    exports often pad: load_model takes tokenizer.json too, ids past the tokenizer are refused
    in requests and never drawn."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from monobatch.engine.engine import Engine
    from monobatch.engine.params import SamplingParams
    from monobatch.engine.scheduler import BatchScheduler
    from monobatch.engine.sequence import Request
    from monobatch.errors import InvalidRequestError
    from monobatch.loader import load_model

    make_hf("llama", tmp_path)
    tok = HFTok(WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    lm = load_model(tmp_path, device="cpu", progress=False)
    assert lm.model.args.vocab_size == 128 and lm.tokenizer.vocab_size == 100
    sched = BatchScheduler(Engine(lm))
    prompt = lm.tokenizer.encode("w1 w2 w3")
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        sched.add_request(Request("b", prompt, SamplingParams(logit_bias={120: 100.0})))
    drawn = []
    for seed in range(4):
        for out in sched.run([Request(f"s{seed}", prompt, SamplingParams(max_tokens=16, temperature=1.5, seed=seed))]):
            drawn += out.token_ids
    assert drawn and max(drawn) < 100
