"""Engine flags, in one table (FLAGS): it generates the parser shared by `strata engine`,
`strata generate`, `strata probe`, `strata tokenize` and the server's config `args`, and the
EngineOptions those commands run with (one field per flag, the flag's default its default).

A row says a flag's spellings, its type and default, its bounds (past them a value is a typo:
FLAG_BOUNDS), the help line (the default is added to it in `--help`), and, for a flag this
build accepts but does not act on, why: such a flag is named in a start-up warning, never
silently ignored (NOT_HONOURED).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable

from strata.experts.budget import CacheRequest, parse_cache_request
from strata.experts.policy import POLICIES
from strata.gguf.row_source import MODES as PLE_IO_MODES
from strata.sampling.bounds import SAMPLING_BOUNDS
from strata.errors import StrataError


class _Parser(argparse.ArgumentParser):
    """argparse that raises StrataError (one line naming the flag) instead of exiting."""

    def error(self, message: str):  # noqa: D401 - argparse hook
        raise StrataError(f"bad engine flag: {message}")


def _prefill(value: str) -> str:
    v = value.strip().lower()
    if v == "auto":
        return v
    if v.startswith("auto:"):
        n = v[5:]
    else:
        n = v
    if not n.isdigit() or int(n) <= 0:
        raise argparse.ArgumentTypeError(f"--prefill takes auto, auto:N or N (N > 0), not {value!r}")
    return v


def _expert_cache(value: str) -> str:
    """argparse type of --expert-cache: its value as given, once it parses (strata.experts.budget)."""
    try:
        parse_cache_request(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value.strip().lower()


def _int_at_least(minimum: int):
    """argparse type: a whole number >= minimum."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {value!r}")
        return n

    return parse


_positive_int = _int_at_least(1)

DAY = 86400.0
PLE_IO = tuple(PLE_IO_MODES)  # mmap (the default), ram, direct


@dataclass(frozen=True)
class Bound:
    """The values a numeric flag takes: past them a value is a typo, not a setting (--threads
    100000 spins 66 threads against 2 cores, --watchdog-s 0.001 restarts the engine at every
    window). `high` may be a function of the machine (its cores); `why` says what bounds it."""

    low: float
    high: float | Callable[[], float]
    whole: bool = True
    why: str = ""

    def top(self) -> float:
        return self.high() if callable(self.high) else self.high


def _cores() -> int:
    from strata.backend.cpu import machine_cores  # (imported when --threads is given: it loads numpy)

    return machine_cores()


def check_api_key(key: str) -> str:
    """A bearer key a client can send (the config's `api_key` and `--api-key`; ValueError says why
    not). It is compared with the token after "Bearer ", which HTTP strips and sends as bytes: ""
    would serve with no key at all, "  " or a non-ASCII key could never be matched."""
    if not key.strip():
        raise ValueError("empty; leave the key out to serve without one")
    if key != key.strip():
        raise ValueError("begins or ends with white space, which a client's header cannot carry")
    if not all(" " <= c <= "~" for c in key):
        raise ValueError("only printable ASCII characters can be sent in an Authorization header")
    return key


def _api_key_flag(value: str) -> str:
    try:
        return check_api_key(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"the key is {e}" if str(e).startswith("empty") else f"the key {e}") from None


def _within(bound: Bound, *, auto: bool = False):
    """argparse type: a number within `bound` (or `auto`, None, where auto is True)."""

    def parse(value: str) -> float | int | None:
        if auto and value.strip().lower() == "auto":
            return None
        high = bound.top()
        kind = "whole number" if bound.whole else "number"
        # "%g" shows 1073741824 as 1.07374e+09: whole bounds are written out
        shown = f"[{bound.low:.0f}, {high:.0f}]" if bound.whole else f"[{bound.low:g}, {high:g}]"
        expected = f"expected {'auto or ' if auto else ''}a {kind} in {shown}" + (f" ({bound.why})" if bound.why else "")
        try:
            v = int(value) if bound.whole else float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{expected}, got {value!r}") from None
        if not bound.low <= v <= high:  # (NaN fails this too)
            raise argparse.ArgumentTypeError(f"{expected}, got {value!r}")
        return v

    return parse


def name_list(value: str) -> list[str]:
    """'a, b' -> ['a', 'b'] (allow-lists of hosts and origins)."""
    return [v.strip() for v in value.split(",") if v.strip()]


def _probability(value: str) -> float:
    try:
        p = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a probability, got {value!r}") from None
    if not 0.0 <= p <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1], got {value!r}")
    return p


# The namespace attribute that lists the engine flags given on the command line, in order (each
# flag's first spelling: --model-name is --alias). Recorded by the parser itself, so every
# command knows them from its namespace alone: telling `--spec 0` given from the default 0
# decides whether the default model's MTP default applies (strata.mtp.defaults).
GIVEN = "given_engine_flags"


def _note_given(ns: argparse.Namespace, action: argparse.Action) -> None:
    setattr(ns, GIVEN, (*getattr(ns, GIVEN, ()), action.option_strings[0]))


class _Store(argparse.Action):
    def __call__(self, parser, ns, values, option_string=None):
        setattr(ns, self.dest, values)
        _note_given(ns, self)


class _StoreTrue(argparse.Action):
    def __init__(self, option_strings, dest, default=False, required=False, help=None):
        super().__init__(option_strings, dest, nargs=0, const=True, default=default, required=required, help=help)

    def __call__(self, parser, ns, values, option_string=None):
        setattr(ns, self.dest, True)
        _note_given(ns, self)


class _Append(argparse.Action):
    def __call__(self, parser, ns, values, option_string=None):
        setattr(ns, self.dest, [*(getattr(ns, self.dest, None) or []), values])
        _note_given(ns, self)


# argparse action name -> the same action, recording that the flag was given
_RECORDING = {"store": _Store, "store_true": _StoreTrue, "append": _Append}


PACK, ENGINE, SERVING = "model", "engine", "serving"  # the argument group of a flag; SERVING: only commands that serve


@dataclass(frozen=True)
class Flag:
    """One engine flag. `names[0]` is its name (the one GIVEN records); its EngineOptions field
    is `attr`: `dest`, else that name without dashes; `kind` is the field's type."""

    names: tuple[str, ...]
    kind: str
    default: Any = None
    help: str | None = None
    group: str = ENGINE
    type: Callable[[str], Any] | None = None
    bound: Bound | None = None  # the values it takes (its type is then the bound's check)
    auto: bool = False  # with a bound: `auto` is taken too, as None
    action: str = "store"  # "store", "store_true" or "append"
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    dest: str | None = None
    not_honoured: str | None = None  # accepted but without effect in this build: why (a start-up warning)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def attr(self) -> str:
        return self.dest or self.name.lstrip("-").replace("-", "_")

    def parse_type(self) -> Callable[[str], Any] | None:
        return _within(self.bound, auto=self.auto) if self.bound is not None else self.type

    def help_text(self) -> str | None:
        """The help line with the default, where the default is a value (not off, not 'none')."""
        shown = self.default not in (None, False, "", []) and "default" not in (self.help or "")
        if not shown:
            return self.help
        return f"{self.help} (default: {self.default})" if self.help else f"default: {self.default}"

    def add_to(self, group) -> None:
        default = list(self.default) if isinstance(self.default, list) else self.default  # (one list per parser)
        kw: dict[str, Any] = {"dest": self.attr, "default": default, "help": self.help_text()}
        if self.action != "store_true":
            kw.update(type=self.parse_type(), choices=self.choices, metavar=self.metavar)
        given = {k: v for k, v in kw.items() if v is not None or k == "default"}
        group.add_argument(*self.names, action=_RECORDING[self.action], **given)

    def dataclass_field(self) -> Any:
        """The EngineOptions field: a list default is a fresh list per object."""
        if isinstance(self.default, list):
            return field(default_factory=lambda d=self.default: list(d))
        return field(default=self.default)


FLAGS: tuple[Flag, ...] = (
    Flag(("--pack",), "str | None", group=PACK,
         help="pack directory or GGUF file (default: the bundled SmolLM2-135M-Instruct)"),
    Flag(("--native",), "str | None", group=PACK,
         help="the pack's main file, or any shard of its split (relative to --pack DIR); the other shards "
              "are found by their NAME-0000k-of-0000n.gguf names"),
    Flag(("--ple-gguf",), "list[str]", [], group=PACK, action="append",
         help="a shard of the pack's split (held to its split.* keys), or a file of tensors the pack lacks "
              "(e.g. the n-gram table); repeatable"),
    Flag(("--mtp",), "str | None", help="MTP draft (file or directory); default: nextn tensors in the pack, else a "
                                        "shipped draft made for the pack, if any"),
    Flag(("--spec",), "int", 0, bound=Bound(0, 16, why="drafts past the first few are almost never accepted"),
         help="draft up to K tokens per window (0: no MTP)"),
    Flag(("--spec-min-p",), "float", 0.0, type=_probability, help="stop drafting when the draft's top probability is under P"),
    Flag(("--batch-mtp",), "bool", False, action="store_true",
         help="every slot verifies its own MTP proposal inside the batched window"),
    Flag(("--parallel",), "int", 1, bound=Bound(1, 1024), help="number of slots (concurrent sequences)"),
    # None: auto (strata/engine/checkpoints.py)
    Flag(("--state-checkpoints",), "int | None", bound=Bound(0, 1024), auto=True, metavar="N|auto",
         help="hybrid models: how many slots keep a rollback copy of their recurrent state (the "
              "others never draft and decode one token per window); auto: as many as memory holds"),
    Flag(("--prefill",), "str", "auto", type=_prefill, help="prefill chunking: auto, auto:N or N tokens per chunk"),
    # (what the pack's memory holds is checked at load)
    Flag(("--max-context",), "int | None", bound=Bound(1, 1 << 30), help="context length per sequence (default: the model's)"),
    Flag(("--kv",), "str", "f16", choices=("f16", "int8"), help="KV cache storage"),
    Flag(("--prefix-cache",), "int", 1024, bound=Bound(0, 1 << 20, why="MiB: 1 TiB"), metavar="MIB",
         help="memory for reusing computed prompt prefixes across requests (0: off)"),
    Flag(("--kv-resident",), "int | None", bound=Bound(1, 1 << 30), help="(accepted; see warnings)",
         not_honoured="the whole KV cache stays resident; there is no host spill tier"),
    # (strata/gguf/row_source.py: the three sources)
    Flag(("--ple-io",), "str", "mmap", choices=PLE_IO, metavar="|".join(PLE_IO),
         help="how the n-gram table (qwen4exp's per_layer_token_embd: 26.8 GiB on the real model, 16 rows a "
              "token) is read; it stays on the host, never on the GPU. mmap: the file's map, nothing read "
              "at load, rows kept by the page cache (which the OS may evict); ram: copied into process memory "
              "at load (its whole size in RAM, a load that takes a while), then every row at memory speed; "
              "direct: each window's rows read from the file (O_DIRECT where the OS and file system allow: no "
              "page cache used, a read per run of rows every window). No effect on packs without the table"),
    # (strata/experts/: the pool's bookkeeping, its policies and the profile file)
    Flag(("--expert-cache",), "str", "auto", type=_expert_cache, metavar="auto|off|SIZE|N%",
         help="routed experts behind a pool of slots: SIZE of memory (512MiB, 20GiB) or N%% of the experts; "
              "auto: every expert resident where they fit beside the rest, else as many slots as fit; off: all "
              "resident. On the CPU the slots hold float32 experts and the rest stay quantized in the pack file, "
              "dequantized on a miss; the CUDA backend has no pool yet (every expert resident)"),
    Flag(("--expert-policy",), "str", "frequency", choices=tuple(POLICIES), metavar="|".join(POLICIES),
         help="which cached expert leaves the pool for a missing one: lru, or frequency (frequency-weighted "
              "LRU: decayed use counts)"),
    Flag(("--expert-profile",), "str | None", metavar="FILE",
         help="per-layer expert routing counts (`strata experts profile` writes them): the pool starts with "
              "the hottest experts and the policy with their counts (one that cannot be read, or is another "
              "model's, is a warning: the pool starts empty)"),
    Flag(("--expert-profile-out",), "str | None", metavar="FILE",
         help="write the routing counts this engine saw to FILE when it stops (an --expert-profile file; "
              "nothing is written before a request has run)"),
    Flag(("--device",), "str", "auto", choices=("auto", "cpu", "cuda"), help="compute backend"),
    Flag(("--no-native",), "str", "", metavar="TYPES",
         help="diagnostic: comma-separated GGML types to drop from the native kernel table"),
    Flag(("--threads",), "int | None",
         bound=Bound(1, _cores, why="this machine's cores: more BLAS threads only wait on each other"),
         help="CPU BLAS threads (default: STRATA_CPU_THREADS, else the cores other work leaves free: the usable "
              "cores minus the 1-minute load average, at least 1)"),
    Flag(("--host",), "str", "127.0.0.1", group=SERVING, help="listen address"),
    Flag(("--port",), "int", 8080, group=SERVING, bound=Bound(0, 65535), help="listen port (0 picks a free port)"),
    Flag(("--alias", "--model-name"), "str | None", group=SERVING,
         help="model id served on /v1/models (default: the pack's file name without .gguf)"),
    Flag(("--api-key",), "str | None", group=SERVING, type=_api_key_flag, help="require this bearer key"),
    Flag(("--max-queued",), "int", 64, group=SERVING, bound=Bound(0, 100_000),
         help="requests that may wait for a slot; more get HTTP 429"),
    Flag(("--body-timeout",), "float", 30.0, group=SERVING, bound=Bound(0, DAY, whole=False, why="seconds; 0: no limit"),
         metavar="S", help="seconds a request body may take to arrive; then HTTP 408 (0: no limit)"),
    Flag(("--allowed-hosts",), "list[str] | None", group=SERVING, type=name_list, metavar="H1,H2",
         help="Host names served besides the loopback ones ('*': any); default: any unless bound to loopback"),
    Flag(("--allowed-origins",), "list[str]", [], group=SERVING, type=name_list, metavar="O1,O2",
         help="web origins (scheme://host[:port]) allowed besides loopback pages ('*': any)"),
    # generous: a window of a large model on a CPU can take seconds
    Flag(("--watchdog-s",), "float", 120.0, group=SERVING, metavar="S",
         bound=Bound(1, 7 * DAY, whole=False, why="seconds: under 1 s an ordinary window trips it"),
         help="/health answers 503 (and strata serve restarts the engine) when one window runs longer"),
    # (strata/server/route_privacy.py)
    Flag(("--slots",), "bool", False, group=SERVING, action="store_true",
         help="GET /slots shows each running request's sampling and id (off: states and counters only)"),
    Flag(("--no-access-log",), "bool", False, group=SERVING, action="store_true",
         help="no access-log line per request (method, route, status, tokens, time)"),
)

# flag -> its bound (the server config's keys of the same meaning have the same bounds, in
# strata/server/config.py's NUMBER_BOUNDS)
FLAG_BOUNDS: dict[str, Bound] = {f.name: f.bound for f in FLAGS if f.bound is not None}
# flag -> why it has no effect in this build (said once at start-up when the flag is given)
NOT_HONOURED: dict[str, str] = {f.name: f.not_honoured for f in FLAGS if f.not_honoured is not None}


def in_bounds(flag: str, *, auto: bool = False):
    """argparse type: a number within FLAG_BOUNDS[flag] (or `auto`, None, where auto is True)."""
    return _within(FLAG_BOUNDS[flag], auto=auto)


port_number = in_bounds("--port")  # also `strata serve --port`


def _add_flags(p: argparse.ArgumentParser, groups: tuple[str, ...], title: str) -> None:
    g = p.add_argument_group(title)
    for f in FLAGS:
        if f.group in groups:
            f.add_to(g)


def add_pack_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that name the model's files (all `strata tokenize` needs)."""
    _add_flags(p, (PACK,), "model")


def add_engine_arguments(p: argparse.ArgumentParser, *, serving: bool = True) -> None:
    """Add every engine flag to parser p (used by several commands); `serving`: also the flags
    of a command that serves HTTP."""
    _add_flags(p, (PACK, ENGINE, SERVING) if serving else (PACK, ENGINE), "engine")


def bounded(name: str):
    """argparse type: a value in SAMPLING_BOUNDS[name], the range the HTTP API takes for the same
    field (`strata generate --top-p 5` is refused as a request's top_p 5 is)."""
    bound = SAMPLING_BOUNDS[name]

    def parse(value: str):
        try:
            v = int(value) if bound.whole else float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {bound.describe()}, got {value!r}") from None
        if not bound.holds(v):
            raise argparse.ArgumentTypeError(f"expected {bound.describe()}, got {value!r}")
        return v

    return parse


class _OptionsMethods:
    """What EngineOptions (a dataclass of FLAGS' fields, below) computes from its flags."""

    given_flags: tuple[str, ...]
    prefill: str
    no_native: str
    expert_cache: str

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, argv: list[str] | None = None) -> "EngineOptions":
        known = {f for f in cls.__dataclass_fields__ if f != "given_flags"}
        values = {k: v for k, v in vars(ns).items() if k in known}
        if argv is None:  # the flags the parser recorded (add_engine_arguments)
            given = tuple(getattr(ns, GIVEN, ()))
        else:
            given = tuple(a.split("=", 1)[0] for a in argv if a.startswith("--"))
        return cls(**values, given_flags=given)

    def prefill_chunk(self) -> int:
        """Tokens per prefill chunk: auto = 512, auto:N = min(N, 512) sized by the backend later, N = N."""
        v = self.prefill
        if v == "auto":
            return 512
        if v.startswith("auto:"):
            return int(v[5:])
        return int(v)

    def no_native_types(self) -> set[str]:
        return {t.strip().upper() for t in self.no_native.split(",") if t.strip()}

    def warnings(self) -> list[str]:
        """Start-up warnings for flags this build accepts but does not act on."""
        out = []
        for flag, why in NOT_HONOURED.items():
            if flag in self.given_flags:
                out.append(f"strata: warning: {flag} is accepted but has no effect in this build: {why}")
        return out

    def expert_cache_request(self) -> CacheRequest:
        return parse_cache_request(self.expert_cache)


# the options a command runs with: one field per flag of FLAGS, its default the flag's, and the
# flags given on its command line (given_flags: a flag given at its default value counts)
EngineOptions = make_dataclass(
    "EngineOptions", [(f.attr, f.kind, f.dataclass_field()) for f in FLAGS] + [("given_flags", "tuple[str, ...]", ())],
    bases=(_OptionsMethods,), namespace={"__module__": __name__})


def parse_engine_args(argv: list[str], *, serving: bool = True, prog: str = "strata engine") -> EngineOptions:
    p = _Parser(prog=prog, add_help=True, allow_abbrev=False)
    add_engine_arguments(p, serving=serving)
    return EngineOptions.from_namespace(p.parse_args(argv))
