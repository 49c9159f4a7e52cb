"""The model: transformer.py (the one model class: embedding, blocks, head; windows and graphs),
archs/ (ARCHS, one file per architecture), layers/ (the shared layers they stack), config.py
(hyperparameters from metadata), state.py, kv_cache.py and recurrent_state.py (a sequence's state)."""
