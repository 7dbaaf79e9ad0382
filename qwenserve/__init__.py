"""qwen-serve: disaggregated serving for Qwen language models."""

__version__ = "0.1.0"
