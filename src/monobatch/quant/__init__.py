"""Packed (quantized) weights: GGUF block types repacked once at load (:mod:`.formats`) and held as
:class:`.packed.PackedWeight`, whose matmul dequantizes inside the kernel (on CPU, decode rows: an integer GEMV on int16-rounded
activations; ADR 0006)."""
