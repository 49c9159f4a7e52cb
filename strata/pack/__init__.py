"""Model packs: GGUF files joined into one namespace, validation, synthetic packs."""

from strata.pack.loader import Pack, open_pack
from strata.pack.validate import check_arch, check_shape

__all__ = ["Pack", "check_arch", "check_shape", "open_pack"]
