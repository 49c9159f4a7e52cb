"""A tensor too large for the device, read on the host by rows: qwen4exp's n-gram table (26.8 GiB on
the real model, 320M rows of 160 IQ4_NL values, 90 bytes each; 16 rows a token). Each window
reads the rows its tokens hash to; the table itself never leaves the host. `--ple-io` picks
how (HostTables.mode), one protocol for all:

    RowSource.rows(indices) -> (m, row_bytes) uint8, the raw blocks of rows indices[0..m)

- mmap (MappedRows): rows sliced out of the file's read-only map (strata/gguf/reader.py).
  Nothing is read at load; a row first read is a page fault, later reads hit the page cache,
  which the kernel gives back under memory pressure. No memory of its own.
- ram (RamRows): the tensor copied into the process at load (a progress line every 10% when it
  is large); a row is then always a memory copy, never a disk read or an eviction. Costs its
  whole size in RAM for the run, refused in one line where the host has less available.
- direct (DirectRows): positional reads of the rows' bytes from the file, no map. With O_DIRECT
  (Linux, where the file system takes it) each read is whole 4 KiB pages into a page-aligned
  buffer and skips the page cache: steady cost, no cache to fill or evict. Elsewhere plain
  positional reads (os.preadv), and on Windows, which has no os.pread, one handle's seek +
  readinto under a lock. Costs a read per run of adjacent rows, every window; a window's reads
  are spread over threads, so that the disk serves them side by side.

Every source reads a window's distinct rows once (np.unique: the EOS context and repeated
n-grams give duplicates), in file order, and hands them back in the order asked.
"""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from strata.errors import StrataError
from strata.gguf.reader import TensorInfo
from strata.host_memory import available_host_bytes
from strata.units import size_text

# tensors that stay on the host whatever the backend, read by rows (the memory estimates leave them out)
HOST_ROW_TENSORS = ("per_layer_token_embd",)

ALIGN = 4096  # O_DIRECT's unit for offsets, lengths and buffer addresses: a page covers every usual block size
# where the OS has O_DIRECT at all (Linux, the BSDs); 0 elsewhere (macOS, Windows)
O_DIRECT = getattr(os, "O_DIRECT", 0)
READ_THREADS = 16  # direct's reads in flight at once
SPLIT_FROM = 4  # runs per thread, at least, before a window's reads are split
PROGRESS_FROM = 1 << 30  # a ram copy at least this large says how far it got, every 10%
COPY_CHUNK = 64 << 20  # bytes per read of the ram copy


class RowSource(Protocol):
    n_rows: int
    row_bytes: int
    where: str  # how the rows are held and read, as the start-up line says it

    def rows(self, indices: np.ndarray) -> np.ndarray: ...


class _Rows(ABC):
    """What every source shares: a window's distinct rows read once, in file order (`_read` of
    sorted unique indices), then put back in the order asked."""

    n_rows: int
    row_bytes: int

    def rows(self, indices: np.ndarray) -> np.ndarray:
        flat = np.asarray(indices, dtype=np.int64).reshape(-1)
        if flat.size == 0:
            return np.empty((0, self.row_bytes), np.uint8)
        uniq, inverse = np.unique(flat, return_inverse=True)
        if uniq[0] < 0 or uniq[-1] >= self.n_rows:
            raise IndexError(f"row {uniq[0] if uniq[0] < 0 else uniq[-1]} outside [0, {self.n_rows})")
        return self._read(uniq)[inverse.reshape(-1)]

    @abstractmethod
    def _read(self, rows: np.ndarray) -> np.ndarray:
        """The raw rows of sorted, distinct indices, (len(rows), row_bytes) uint8."""


def _geometry(info: TensorInfo, row_bytes: int) -> int:
    if row_bytes <= 0 or info.nbytes % row_bytes:
        raise StrataError(f"tensor {info.name}: {info.nbytes} bytes are not whole rows of {row_bytes}")
    return info.nbytes // row_bytes


class MappedRows(_Rows):
    """Rows sliced from the file's map; the map's pages over the tensor are advised random: a
    miss reads its page, not the device's read-ahead window around it (128 KiB by default, 8 MiB
    on the test machine's disk; docs/MEMORY.md has the measurement)."""

    def __init__(self, info: TensorInfo, row_bytes: int):
        self.n_rows, self.row_bytes = _geometry(info, row_bytes), row_bytes
        self._map = info.data().reshape(self.n_rows, row_bytes)
        pages = "a page per row missed" if info.advise_random() else "the OS's read-around per row missed"
        self.where = f"in host memory via mmap ({pages}; the page cache keeps the rows read)"

    def _read(self, rows: np.ndarray) -> np.ndarray:
        return self._map[rows]


def _host_buffer(n: int) -> np.ndarray:
    """n bytes of process memory. Where the OS can (Linux's MAP_POPULATE) the kernel makes all
    its pages in one pass: 0.6 s a GiB on the test machine, against 2.9 s for faulting them in
    one at a time as the copy first touches them."""
    populate = getattr(mmap, "MAP_POPULATE", 0)  # Linux only
    if not populate:
        return np.empty(n, np.uint8)
    return np.frombuffer(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate), np.uint8)


class RamRows(_Rows):
    """The tensor's bytes copied from its file into process memory once, at load."""

    def __init__(self, info: TensorInfo, row_bytes: int, what: str, flag: str,
                 say: Callable[[str], None] | None = None):
        self.n_rows, self.row_bytes = _geometry(info, row_bytes), row_bytes
        n, free = info.nbytes, available_host_bytes()
        lacking = lambda why: (f"{flag} ram: the {what} takes {size_text(n)} of host memory, and {why} "  # noqa: E731
                               f"({flag} mmap or direct read it from the file instead)")
        if free is not None and n > free:
            raise StrataError(lacking(f"{size_text(free)} is available"))
        t0 = time.perf_counter()
        try:
            flat_array = _host_buffer(n)
        except (MemoryError, OSError):
            raise StrataError(lacking("the allocation was refused")) from None
        self._ram = flat_array.reshape(self.n_rows, row_bytes)
        flat = memoryview(flat_array)
        tenth = 0
        with open(info.path, "rb", buffering=0) as f:
            f.seek(info.offset)
            done = 0
            while done < n:
                got = f.readinto(flat[done : min(n, done + COPY_CHUNK)])
                if not got:
                    raise StrataError(f"{info.path}: ended {n - done} bytes into tensor {info.name}")
                done += got
                if say is not None and n >= PROGRESS_FROM and done * 10 // n > tenth:
                    tenth = done * 10 // n
                    say(f"strata: {what}: copying into memory: {10 * tenth}% ({size_text(done)} of "
                        f"{size_text(n)}, {time.perf_counter() - t0:.1f} s)")
        self.where = f"in host memory via ram (copied at load in {time.perf_counter() - t0:.1f} s)"

    def _read(self, rows: np.ndarray) -> np.ndarray:
        return self._ram[rows]


class PositionalFile:
    """POSIX: os.preadv at any offset, safe from any thread; O_DIRECT when asked (then `align`
    is ALIGN: every offset, length and buffer address a multiple of it)."""

    concurrent = True  # reads from several threads at once overlap

    def __init__(self, path: os.PathLike, direct: bool):
        self.align = ALIGN if direct else 1
        self._fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
        self._closer = weakref.finalize(self, os.close, self._fd)  # (a model dropped closes its file)

    def read_into(self, view: memoryview, offset: int) -> int:
        got = 0
        while got < len(view):
            n = os.preadv(self._fd, [view[got:]], offset + got)
            if n == 0:  # the end of the file (an aligned span may reach past it)
                break
            got += n
        return got

    def close(self) -> None:
        self._closer()


class SeekingFile:
    """Windows (no pread there): one unbuffered handle, seek + readinto under a lock."""

    align = 1
    concurrent = False  # the lock makes them take turns

    def __init__(self, path: os.PathLike):
        self._f = open(path, "rb", buffering=0)
        self._lock = threading.Lock()

    def read_into(self, view: memoryview, offset: int) -> int:
        got = 0
        with self._lock:
            self._f.seek(offset)
            while got < len(view):
                n = self._f.readinto(view[got:])
                if not n:
                    break
                got += n
        return got

    def close(self) -> None:
        self._f.close()


def _aligned(n: int) -> np.ndarray:
    """n bytes at an ALIGN-aligned address (O_DIRECT reads into nothing else)."""
    raw = np.empty(n + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + n]


def open_for_rows(path: os.PathLike, first: int) -> tuple[PositionalFile | SeekingFile, str]:
    """The file opened for positional reads, and how, in words. O_DIRECT is tried where the OS
    has it, with one read of the page holding byte `first` (some file systems take the open and
    refuse the reads); refused, plain reads, said in the words."""
    if os.name == "nt":
        return SeekingFile(path), "seek + read under a lock, through the page cache (Windows has no os.pread)"
    if not O_DIRECT:
        return PositionalFile(path, False), "plain positional reads (no O_DIRECT on this platform)"
    f = None
    try:
        f = PositionalFile(path, True)
        f.read_into(memoryview(_aligned(ALIGN)), first // ALIGN * ALIGN)
        return f, f"O_DIRECT reads of {ALIGN}-byte aligned spans, past the page cache"
    except OSError as e:
        if f is not None:
            f.close()
        why = e.strerror or type(e).__name__
    return PositionalFile(path, False), f"plain positional reads through the page cache (O_DIRECT refused: {why})"


class DirectRows(_Rows):
    """Rows read from the file by position, no map (module doc). A window's rows become runs:
    rows whose (aligned) byte spans touch or overlap are one read. A window of many runs splits
    them among READ_THREADS threads where the file takes concurrent reads: each read waits on
    the disk with the GIL released, and an SSD serves many at once, so the window waits for
    about its share, not the sum."""

    def __init__(self, info: TensorInfo, row_bytes: int,
                 opener: Callable[[os.PathLike, int], tuple[PositionalFile | SeekingFile, str]] = open_for_rows):
        self.n_rows, self.row_bytes = _geometry(info, row_bytes), row_bytes
        self.path, self.base = info.path, info.offset
        try:
            self.file, how = opener(info.path, info.offset)
        except OSError as e:
            raise StrataError(f"{info.path}: cannot open for reading ({e.strerror})") from None
        self.where = f"on disk, read per window via direct: {how}"
        self._pool: ThreadPoolExecutor | None = None  # made at the first window with many runs

    def _read(self, rows: np.ndarray) -> np.ndarray:
        rb, a = self.row_bytes, self.file.align
        start = self.base + rows * rb  # sorted: so are lo and hi
        lo, hi = start // a * a, -(-(start + rb) // a) * a
        new = np.empty(rows.size, bool)
        new[0], new[1:] = True, lo[1:] > hi[:-1]
        first = np.flatnonzero(new)
        last = np.append(first[1:] - 1, rows.size - 1)
        span_lo, sizes = lo[first], hi[last] - lo[first]
        at = np.cumsum(sizes) - sizes  # each run's place in the buffer
        need = start[last] + rb - span_lo  # a run's read may stop at the end of the file past its rows
        buf = _aligned(int(sizes.sum()))
        view = memoryview(buf)
        runs = list(zip(at.tolist(), span_lo.tolist(), sizes.tolist(), need.tolist()))
        k = min(READ_THREADS, len(runs) // SPLIT_FROM) if self.file.concurrent else 0
        if k > 1:  # contiguous shares, so each thread still reads in file order
            shares = [runs[i * len(runs) // k : (i + 1) * len(runs) // k] for i in range(k)]
            list(self._threads().map(lambda share: self._read_runs(view, share), shares))
        else:
            self._read_runs(view, runs)
        run = np.cumsum(new) - 1
        pos = at[run] + (start - span_lo[run])
        return buf[pos[:, None] + np.arange(rb)]

    def _read_runs(self, view: memoryview, runs: list[tuple[int, int, int, int]]) -> None:
        for place, offset, size, least in runs:
            got = self.file.read_into(view[place : place + size], offset)
            if got < least:
                raise StrataError(f"{self.path}: read {got} of {least} bytes at offset {offset}: the file is "
                                  f"shorter than its tensor table says")

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="strata-rows")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self.file.close()


@dataclass
class HostTables:
    """How tensors that stay on the host are read by rows: one mode for all (MODES), each tensor
    opened once (a table shared by several layers is one source). `flag` names the setting in
    a refusal; `say` takes ram's progress lines."""

    mode: str = "mmap"
    flag: str = "--ple-io"
    say: Callable[[str], None] | None = None
    opened: dict[str, tuple[str, TensorInfo, RowSource]] = field(default_factory=dict)

    def open(self, info: TensorInfo, row_bytes: int, what: str) -> RowSource:
        """The rows of `info` (what: its name in words, "n-gram table")."""
        held = self.opened.get(info.name)
        if held is None:
            if self.mode not in MODES:
                raise StrataError(f"{self.flag}: unknown mode {self.mode!r} (one of {', '.join(MODES)})")
            held = (what, info, MODES[self.mode](self, info, row_bytes, what))
            self.opened[info.name] = held
        return held[2]

    def lines(self) -> list[str]:
        """One start-up line per opened tensor: its size and how it is read."""
        return [f"strata: {what}: {size_text(info.nbytes)} {src.where}" for what, info, src in self.opened.values()]


# mode -> (the tables' settings, tensor, row bytes, words) -> its RowSource
MODES: dict[str, Callable[[HostTables, TensorInfo, int, str], RowSource]] = {
    "mmap": lambda t, info, rb, what: MappedRows(info, rb),
    "ram": lambda t, info, rb, what: RamRows(info, rb, what, t.flag, t.say),
    "direct": lambda t, info, rb, what: DirectRows(info, rb),
}
