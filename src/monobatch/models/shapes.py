"""Named model shapes for random-weight benchmarks (``monobatch bench --dummy-weights --shape``).

Kept free of torch so the CLI can list them without importing it.
"""

from __future__ import annotations

#: Named shapes (HF config fields; ``model_type`` defaults to ``llama``). smollm2-135m is the
#: bundled model's; llama-1b is Llama 3.2 1B's layout with SmolLM2's vocabulary; llama-8b is
#: Llama 3.1 8B's; gemma3-1b is Gemma 3 1B's (google/gemma-3-1b-pt config.json: 26 layers, every
#: 6th global, the others a 512-token sliding window); tiny is a 2-layer model for smoke and
#: property tests (milliseconds a step on CPU).
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=256, rope_theta=10000.0,
                 tie_word_embeddings=True),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=49152, max_position_embeddings=16384,
                     rope_theta=500000.0, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                     rope_theta=500000.0, tie_word_embeddings=False),
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, intermediate_size=6912, vocab_size=262144,
                      max_position_embeddings=32768, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                      query_pre_attn_scalar=256.0, sliding_window=512, sliding_window_pattern=6,
                      hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
}
