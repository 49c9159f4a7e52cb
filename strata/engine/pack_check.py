"""The start-up check of a pack and its draft that needs no device: what `strata serve` runs
before it starts an engine child and `strata engine` before it says it listens, so a bad file is
one line at once instead of an exit after a load."""

from __future__ import annotations


def check_pack_files(pack: str | None, native: str | None, ple_gguf: list[str] | str | None,
                     mtp: str | None) -> None:
    """Open the pack (its files or split shards, each held to its split.* keys; headers, metadata
    table and tensor shapes; no tensor data is read) and an --mtp draft against it; a StrataError
    names what is wrong."""
    from strata.mtp.draft import find_draft
    from strata.pack.loader import open_pack

    opened = open_pack(pack=pack, native=native, ple_gguf=ple_gguf)
    try:
        opened.model_config()
        if mtp is not None:
            find_draft(mtp, opened)
    finally:
        opened.close()
