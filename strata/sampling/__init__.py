"""Sampling: filters and draws (filters), logit adjustments (logit_adjust), request bounds (bounds), speculative verification (verify)."""
