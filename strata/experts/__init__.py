"""Expert residency for models bigger than the device: every expert in host memory, a pool of
expert slots on the device, and what decides which experts hold the slots.

Nothing here touches a device. `policy` ranks resident experts for eviction (LRU, or
frequency-weighted LRU); `cache` is the slot pool's bookkeeping (which expert is in which slot,
hits, misses, evictions, bytes uploaded) that a backend's expert store consults before a layer's
experts run; `profile` is the `--expert-profile` file (per-layer routing counts) that seeds it;
`budget` turns `--expert-cache` into slots per pool.
"""
