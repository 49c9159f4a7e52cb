"""Engine flags: one parser shared by `strata engine`, `strata generate`, `strata probe`,
`strata tokenize` and the server's config `args`.

Every flag of the seed config is accepted. Flags this build accepts but does not act on
are listed in NOT_HONOURED and named in a start-up warning (never silently ignored).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable

from strata.sampling.bounds import SAMPLING_BOUNDS
from strata.errors import StrataError

# flag -> why it has no effect in this build (said once at start-up when the flag is given)
NOT_HONOURED: dict[str, str] = {
    "--expert-profile": "expert profiles only steer host-offloaded expert caches; every expert stays resident",
    "--kv-resident": "the whole KV cache stays resident; there is no host spill tier",
}


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


# flag -> its bound (the server config's keys of the same meaning have the same bounds, in
# strata/server/config.py's NUMBER_BOUNDS)
FLAG_BOUNDS: dict[str, Bound] = {
    "--spec": Bound(0, 16, why="drafts past the first few are almost never accepted"),
    "--parallel": Bound(1, 1024),
    "--state-checkpoints": Bound(0, 1024),
    "--max-context": Bound(1, 1 << 30),  # (what the pack's memory holds is checked at load)
    "--prefix-cache": Bound(0, 1 << 20, why="MiB: 1 TiB"),
    "--kv-resident": Bound(1, 1 << 30),
    "--threads": Bound(1, _cores, why="this machine's cores: more BLAS threads only wait on each other"),
    "--port": Bound(0, 65535),
    "--max-queued": Bound(0, 100_000),
    "--body-timeout": Bound(0, DAY, whole=False, why="seconds; 0: no limit"),
    "--watchdog-s": Bound(1, 7 * DAY, whole=False,
                          why="seconds: under 1 s an ordinary window trips it"),
}


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


def in_bounds(flag: str, *, auto: bool = False):
    """argparse type: a number within FLAG_BOUNDS[flag] (or `auto`, None, where auto is True)."""
    bound = FLAG_BOUNDS[flag]

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


port_number = in_bounds("--port")  # also `strata serve --port`


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


class _Flags:
    """An argument group whose flags record themselves in the namespace's GIVEN."""

    def __init__(self, group):
        self.group = group

    def add_argument(self, *names, action: str = "store", **kw):
        return self.group.add_argument(*names, action=_RECORDING[action], **kw)


def add_pack_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that name the model's files (all `strata tokenize` needs)."""
    _add_pack_flags(_Flags(p.add_argument_group("model")))


def _add_pack_flags(g: _Flags) -> None:
    g.add_argument("--pack", help="pack directory or GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--native", help="main shard of the pack (relative to --pack DIR)")
    g.add_argument("--ple-gguf", action="append", default=[], help="extra shard whose tensors join the pack")


def add_engine_arguments(p: argparse.ArgumentParser, *, serving: bool = True) -> None:
    """Add every engine flag to parser p (used by several commands)."""
    g = _Flags(p.add_argument_group("engine"))
    _add_pack_flags(g)
    g.add_argument("--mtp", help="MTP draft (file or directory); default: nextn tensors in the pack, else a "
                                 "shipped draft made for the pack, if any")
    g.add_argument("--spec", type=in_bounds("--spec"), default=0, help="draft up to K tokens per window (0: no MTP)")
    g.add_argument("--spec-min-p", type=_probability, default=0.0, help="stop drafting when the draft's top probability is under P")
    g.add_argument("--batch-mtp", action="store_true", help="every slot verifies its own MTP proposal inside the batched window")
    g.add_argument("--parallel", type=in_bounds("--parallel"), default=1, help="number of slots (concurrent sequences)")
    g.add_argument("--state-checkpoints", type=in_bounds("--state-checkpoints", auto=True), default=None, metavar="N|auto",
                   help="hybrid models: how many slots keep a rollback copy of their recurrent state (the "
                        "others never draft and decode one token per window); auto: as many as memory holds")
    g.add_argument("--prefill", type=_prefill, default="auto", help="prefill chunking: auto, auto:N or N tokens per chunk")
    g.add_argument("--max-context", type=in_bounds("--max-context"), default=None, help="context length per sequence (default: the model's)")
    g.add_argument("--kv", choices=("f16", "int8"), default="f16", help="KV cache storage")
    g.add_argument("--prefix-cache", type=in_bounds("--prefix-cache"), default=1024, metavar="MIB",
                   help="memory for reusing computed prompt prefixes across requests (0: off)")
    g.add_argument("--kv-resident", type=in_bounds("--kv-resident"), default=None, help="(accepted; see warnings)")
    g.add_argument("--expert-profile", default=None, help="(accepted; see warnings)")
    g.add_argument("--expert-cache", default="auto", help="expert cache policy: auto (all experts resident)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="compute backend")
    g.add_argument("--no-native", default="", metavar="TYPES",
                   help="diagnostic: comma-separated GGML types to drop from the native kernel table")
    g.add_argument("--threads", type=in_bounds("--threads"), default=None,
                   help="CPU BLAS threads (default: STRATA_CPU_THREADS, else the cores other work leaves free: the usable cores minus the 1-minute load average, at least 1)")
    if serving:
        g.add_argument("--host", default="127.0.0.1")
        g.add_argument("--port", type=port_number, default=8080)
        g.add_argument("--alias", "--model-name", dest="alias", default=None,
                       help="model id served on /v1/models (default: the pack's file name without .gguf)")
        g.add_argument("--api-key", type=_api_key_flag, default=None, help="require this bearer key")
        g.add_argument("--max-queued", type=in_bounds("--max-queued"), default=64,
                       help="requests that may wait for a slot; more get HTTP 429")
        g.add_argument("--body-timeout", type=in_bounds("--body-timeout"), default=30.0, metavar="S",
                       help="seconds a request body may take to arrive; then HTTP 408 (0: no limit)")
        g.add_argument("--allowed-hosts", type=name_list, default=None, metavar="H1,H2",
                       help="Host names served besides the loopback ones ('*': any); default: any unless bound to loopback")
        g.add_argument("--allowed-origins", type=name_list, default=[], metavar="O1,O2",
                       help="web origins (scheme://host[:port]) allowed besides loopback pages ('*': any)")
        # generous: a window of a large model on a CPU can take seconds
        g.add_argument("--watchdog-s", type=in_bounds("--watchdog-s"), default=120.0, metavar="S",
                       help="/health answers 503 (and strata serve restarts the engine) when one window runs longer")
        g.add_argument("--slots", action="store_true",
                       help="GET /slots shows each running request's sampling and id (off: states and counters only)")
        g.add_argument("--no-access-log", action="store_true",
                       help="no access-log line per request (method, route, status, tokens, time)")


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


@dataclass
class EngineOptions:
    pack: str | None = None
    native: str | None = None
    ple_gguf: list[str] = field(default_factory=list)
    mtp: str | None = None
    spec: int = 0
    spec_min_p: float = 0.0
    batch_mtp: bool = False
    parallel: int = 1
    state_checkpoints: int | None = None  # None: auto (strata/engine/checkpoints.py)
    prefill: str = "auto"
    max_context: int | None = None
    kv: str = "f16"
    prefix_cache: int = 1024  # MiB
    kv_resident: int | None = None
    expert_profile: str | None = None
    expert_cache: str = "auto"
    device: str = "auto"
    no_native: str = ""
    threads: int | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    alias: str | None = None
    api_key: str | None = None
    max_queued: int = 64
    body_timeout: float = 30.0
    allowed_hosts: list[str] | None = None
    allowed_origins: list[str] = field(default_factory=list)
    watchdog_s: float = 120.0
    no_access_log: bool = False
    slots: bool = False  # GET /slots shows each request's sampling and id (strata/server/route_privacy.py)
    given_flags: tuple[str, ...] = ()

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
        if self.expert_cache not in ("auto", "off", "all"):
            out.append(f"strata: warning: --expert-cache {self.expert_cache}: only 'auto' (all experts resident) is built")
        return out


def parse_engine_args(argv: list[str], *, serving: bool = True, prog: str = "strata engine") -> EngineOptions:
    p = _Parser(prog=prog, add_help=True, allow_abbrev=False)
    add_engine_arguments(p, serving=serving)
    return EngineOptions.from_namespace(p.parse_args(argv))
