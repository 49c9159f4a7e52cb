"""The hybrid linear-attention family: Qwen3-Next and Qwen3.5 (dense and MoE)."""
