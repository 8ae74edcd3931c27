"""monobatch: one batch-native LLM inference engine for every door — CLI, server, Python API."""

__version__ = "0.1.0"
