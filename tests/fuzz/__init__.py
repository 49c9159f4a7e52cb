"""GGUF fuzzing: mutated packs of every architecture through the real load path.

layout.py finds where each field of a GGUF file lies, mutate.py makes mutants from a seed pack
(byte-level and metadata rewrites), worker.py loads mutants in a bounded child process and
harness.py drives the workers. `python -m tests.fuzz.harness --mutants 3000` runs a larger
campaign by hand; STRATA_FUZZ_MUTANTS does the same for the test.
"""
