"""Packed (quantized) weights: GGUF block types repacked once at load (:mod:`.formats`) and held as
:class:`.packed.PackedWeight`, whose matmul dequantizes inside the kernel (ADR 0006)."""
