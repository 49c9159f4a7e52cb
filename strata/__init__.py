"""Strata: a single-GPU inference engine and OpenAI-compatible server for GGUF models."""

__version__ = "0.1.0"
