r"""`strata serve` configuration: JSON with comments, read into a pydantic model.

The file is JSON plus `//` and `/* */` comments and trailing commas. Comment markers inside
strings ("http://x") are text, not comments. Windows paths are accepted as users write
them: "C:\\models\\x" (proper JSON) and also "C:\models\x" (raw backslashes, which plain
JSON would reject).

Unknown keys are named in a warning; a bad value is one StrataError line naming the key.
What a file may hold is bounded, so no file takes the reader down: a regular file of at most
MAX_CONFIG_BYTES, objects nested at most MAX_DEPTH deep, no key twice in one object, finite
numbers within each key's bounds (NUMBER_BOUNDS), integers of at most MAX_INT_DIGITS digits.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Callable, Sequence

from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from strata.engine.options import check_api_key, parse_engine_args
from strata.errors import StrataError

_VALID_ESCAPES = set('"\\/bfnrtu')
# "C:\x" with a single backslash after the drive: a raw Windows path
_RAW_DRIVE_PATH = re.compile(r"^[A-Za-z]:\\(?!\\)")

# engine flags whose values are paths; relative ones are taken from the config file's folder
PATH_FLAGS = ("--pack", "--mtp", "--expert-profile")
# shard names, which the loader looks for in the --pack folder first (the report's config names
# bare shard files beside a --pack folder): made absolute against that folder when the file is
# there, else against the config's folder like the other paths
PACK_RELATIVE_FLAGS = ("--native", "--ple-gguf")
# engine flags `strata serve` sets itself
SERVE_OWNED_FLAGS = ("--host", "--port", "--api-key")


def _decode_string(raw: str) -> str:
    """raw = the characters between the quotes, as written in the file."""
    has_bad_escape = False
    i = 0
    while i < len(raw):
        if raw[i] == "\\":
            nxt = raw[i + 1] if i + 1 < len(raw) else ""
            if nxt not in _VALID_ESCAPES:
                has_bad_escape = True
                break
            i += 2
        else:
            i += 1
    if has_bad_escape or _RAW_DRIVE_PATH.match(raw):
        return raw  # written as a raw Windows path: every backslash is literal
    return json.loads(f'"{raw}"')


def strip_jsonc(text: str) -> str:
    """JSON-with-comments -> plain JSON. Line numbers are kept so JSON errors point at the file."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                if text[j] == "\n":
                    break
                j += 2 if text[j] == "\\" else 1
            if j >= n or text[j] != '"':
                out.append(text[i:j])  # unterminated: let the JSON parser report it
                i = j
                continue
            raw = text[i + 1:j]
            try:
                out.append(json.dumps(_decode_string(raw), ensure_ascii=False))
            except json.JSONDecodeError:
                out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise StrataError("unterminated /* comment")
            out.append("\n" * text.count("\n", i, j))
            i = j + 2
        elif c in "}]":
            # drop a trailing comma before a closing bracket
            k = len(out) - 1
            while k >= 0 and out[k].strip() == "":
                k -= 1
            if k >= 0 and out[k].rstrip().endswith(","):
                comma = len(out[k].rstrip()) - 1
                out[k] = out[k][:comma] + out[k][comma + 1:]
            out.append(c)
            i += 1
        else:
            j = i
            while j < n and text[j] not in '"/}]':
                j += 1
            if j == i:  # a lone '/'
                j = i + 1
            out.append(text[i:j])
            i = j
    return "".join(out)


MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes; this leaves room for long comments
MAX_DEPTH = 32  # the deepest real config is 2 (a list in the object); json's reader recurses per level
MAX_INT_DIGITS = 30  # larger than any bound below; Python refuses to convert over 4300 digits

# a token of the plain JSON: a whole string (escapes included) or a bracket or a colon
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:]')


class _LongInteger:
    """An integer literal too long to be any key's value: kept as text so the key's validation
    names it (pydantic refuses it as "not a valid integer") instead of int() raising."""

    def __init__(self, digits: str):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {len(self.digits)} digits>"


def _parse_int(digits: str) -> int | _LongInteger:
    return int(digits) if len(digits) <= MAX_INT_DIGITS else _LongInteger(digits)


def _no_duplicate_keys(source: str):
    def build(pairs: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                # json would keep the last value without a word ("api_key" given twice, the last one "")
                raise StrataError(f"{source}: {key}: given twice in one object; give it once")
            out[key] = value
        return out
    return build


def _check_depth(plain: str, source: str) -> None:
    depth, key, last_string = 0, None, None
    for m in _STRUCTURE.finditer(plain):
        tok = m.group()
        if tok in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                where = f"{key}: " if key else ""
                raise StrataError(f"{source}: {where}nested more than {MAX_DEPTH} levels deep")
        elif tok in "]}":
            depth -= 1
        elif tok == ":":
            if depth == 1:
                key = last_string
        else:
            last_string = tok[1:-1]


def parse_jsonc(text: str, source: str = "config") -> Any:
    plain = strip_jsonc(text)
    _check_depth(plain, source)
    try:
        return json.loads(plain, object_pairs_hook=_no_duplicate_keys(source), parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise StrataError(f"{source}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (RecursionError, ValueError) as e:  # what the checks above leave to json: one line still
        raise StrataError(f"{source}: not a readable JSON config: {e}") from None


def _read_bounded(path: str) -> str:
    """The text of a config file. Only a regular file is read (a FIFO would block, /dev/zero never
    end), and at most MAX_CONFIG_BYTES of it. O_NONBLOCK: opening a FIFO returns at once so that
    fstat can tell what it is."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise StrataError(f"config file {path} not found") from None
    except OSError as e:
        raise StrataError(f"config file {path}: cannot read: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StrataError(f"config file {path}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise StrataError(f"config file {path}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise StrataError(f"config file {path}: larger than {MAX_CONFIG_BYTES >> 20} MiB; a config is a few lines")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise StrataError(f"config file {path}: cannot read: not UTF-8 ({e.reason} at byte {e.start})") from None


# (lowest, highest) of each numeric key: a value past these is a typo, not a setting (1e15 bytes
# of request body, a timeout of Infinity); the ones that are 0 mean "no limit" where the docs say so
DAY = 86400.0
NUMBER_BOUNDS: dict[str, tuple[float, float]] = {
    "port": (0, 65535),
    "parallel": (1, 1024),
    "max_queued": (0, 100_000),
    "request_timeout": (0, 7 * DAY),
    "startup_timeout": (0, DAY),  # and above 0: see ServerConfig
    "shutdown_timeout": (0, DAY),
    "max_request_bytes": (1024, 1 << 30),
    "body_timeout": (0, DAY),
    "header_timeout": (0, 3600),  # and above 0
    "max_connections": (1, 1_000_000),
}


def _bounded(key: str, kind: type, **extra: Any) -> Any:
    lo, hi = NUMBER_BOUNDS[key]
    return Annotated[kind, Field(**({"ge": lo} | extra), le=hi)]


def _usable_api_key(key: str | None) -> str | None:
    return None if key is None else check_api_key(key)


class ServerConfig(BaseModel):
    # allow_inf_nan=False: JSON's Infinity and NaN (which Python's reader accepts) are refused by key
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True, allow_inf_nan=False)

    host: str = "127.0.0.1"
    port: _bounded("port", int) = 8080
    parallel: _bounded("parallel", int) | None = None
    args: list[str] = Field(default_factory=list)
    model: str | None = Field(default=None, validation_alias=AliasChoices("model", "alias", "model_name"))
    api_key: Annotated[str | None, AfterValidator(_usable_api_key)] = None
    max_queued: _bounded("max_queued", int) = 64
    request_timeout: _bounded("request_timeout", float) = 600.0  # 0: no limit
    startup_timeout: _bounded("startup_timeout", float, gt=0) = 600.0
    shutdown_timeout: _bounded("shutdown_timeout", float) = 30.0
    max_request_bytes: _bounded("max_request_bytes", int) = 16 * 1024 * 1024
    body_timeout: _bounded("body_timeout", float) = 30.0  # 0: no limit
    # connections that never finish their request head, and how many may be open (strata.server.connections)
    header_timeout: _bounded("header_timeout", float, gt=0) = 10.0
    max_connections: _bounded("max_connections", int) = 512
    # None: loopback names when bound to loopback, else any (docs/SERVER.md, strata.server.edge)
    allowed_hosts: list[str] | None = None
    allowed_origins: list[str] = Field(default_factory=list)
    access_log: bool = True  # one line per request (strata serve --no-access-log: False)

    def engine_parallel(self) -> int:
        if self.parallel is not None:
            return self.parallel
        return parse_engine_args(list(self.args)).parallel


KNOWN_KEYS = {"host", "port", "parallel", "args", "model", "alias", "model_name", "api_key", "max_queued",
              "request_timeout", "startup_timeout", "shutdown_timeout", "max_request_bytes", "body_timeout",
              "allowed_hosts", "allowed_origins", "access_log", "header_timeout", "max_connections"}


def _describe(e: dict) -> str:
    loc = e["loc"]
    key = str(loc[0]) + "".join(f"[{p}]" for p in loc[1:] if isinstance(p, int))
    msg = e["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{key}: {msg} (got {e.get('input')!r})"


def absolute_paths(args: list[str], base: Path) -> list[str]:
    """The config's path flags made absolute (the engine child runs in another folder)."""
    out = _absolute(list(args), PATH_FLAGS, lambda val: base)
    pack = _flag_value(out, "--pack")
    pack_dir = Path(pack) if pack and Path(pack).is_dir() else None
    return _absolute(out, PACK_RELATIVE_FLAGS,
                     lambda val: pack_dir if pack_dir is not None and (pack_dir / val).exists() else base)


def _absolute(out: list[str], flags: tuple[str, ...], base_for) -> list[str]:
    for i, a in enumerate(out):
        flag, eq, val = a.partition("=")
        if flag not in flags:
            continue
        if eq:
            if val and not _is_absolute(val):
                out[i] = f"{flag}={base_for(val) / val}"
        elif i + 1 < len(out) and not _is_absolute(out[i + 1]) and not out[i + 1].startswith("--"):
            out[i + 1] = str(base_for(out[i + 1]) / out[i + 1])
    return out


def _flag_value(args: list[str], flag: str) -> str | None:
    """The last value given to flag (as --flag V or --flag=V), or None."""
    value = None
    for i, a in enumerate(args):
        name, eq, val = a.partition("=")
        if name == flag:
            value = val if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def _is_absolute(p: str) -> bool:
    # a Windows drive or UNC path counts as absolute on every OS
    return os.path.isabs(p) or bool(re.match(r"^[A-Za-z]:[\\/]|^\\\\", p))


def config_from_dict(data: Any, source: str = "config", base_dir: Path | None = None,
                     warn=None) -> ServerConfig:
    if not isinstance(data, dict):
        raise StrataError(f"{source}: the config must be a JSON object, not {type(data).__name__}")
    unknown = sorted(set(data) - KNOWN_KEYS)
    if unknown and warn is not None:
        warn(f"strata: warning: {source}: unknown key(s) ignored: {', '.join(unknown)}")
    known = {k: v for k, v in data.items() if k in KNOWN_KEYS}
    try:
        cfg = ServerConfig.model_validate(known)
    except ValidationError as e:
        raise StrataError(f"{source}: {_describe(e.errors(include_url=False)[0])}") from None
    try:
        opts = parse_engine_args(list(cfg.args))
    except StrataError as e:
        raise StrataError(f"{source}: args: {e.message}") from None
    if cfg.parallel is not None and "--parallel" in opts.given_flags and opts.parallel != cfg.parallel:
        # the engine would get both, and the later one (the key's) would win without a word
        raise StrataError(f"{source}: parallel: {cfg.parallel} disagrees with args' --parallel {opts.parallel}; "
                          f"give one of them")
    for flag in SERVE_OWNED_FLAGS:
        if flag in opts.given_flags and warn is not None:
            warn(f"strata: warning: {source}: args: {flag} is set by strata serve; use the config key instead")
    if base_dir is not None:
        cfg.args = absolute_paths(cfg.args, base_dir)
    return cfg


def load_config(path: str | None, warn=None) -> ServerConfig:
    """Read a config file (None: all defaults, i.e. the bundled test model on 127.0.0.1:8080)."""
    if path is None:
        return ServerConfig()
    p = Path(path)
    text = _read_bounded(path)
    return config_from_dict(parse_jsonc(text, str(path)), str(path), p.resolve().parent, warn)


def with_overrides(cfg: ServerConfig, source: str = "command line", **overrides: Any) -> ServerConfig:
    """cfg with some keys replaced (command-line flags), validated like the file's values."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return cfg
    try:
        return ServerConfig.model_validate(cfg.model_dump() | given)
    except ValidationError as e:
        raise StrataError(f"{source}: {_describe(e.errors(include_url=False)[0])}") from None


def check_engine_start(cfg: ServerConfig, source: str | None = None) -> None:
    """What the engine would refuse at start-up and the server can check before it starts one,
    with the engine's own code: the flags of `args`, the pack (its files, headers, metadata
    table and tensor shapes; no tensor data is read) and an --mtp draft. A StrataError naming
    the config's `args` (source: the config file) comes at once instead of an engine child's
    exit 2 after a spawn. What needs the device (memory, kernels) is left to the engine."""
    from strata.defaults import default_model_path
    from strata.engine.pack_check import check_pack_files

    where = f"{source}: args: " if source else ""
    try:
        opts = parse_engine_args(list(cfg.args))
        pack_arg = opts.pack
        if pack_arg is None and opts.native is None:
            pack_arg = str(default_model_path())
        check_pack_files(pack_arg, opts.native, opts.ple_gguf, opts.mtp)
    except StrataError as e:
        raise StrataError(f"{where}{e.message}") from None


def ensure_default_model_for(engine_args: Sequence[str], log: Callable[[str], None] | None = None) -> Path | None:
    """Fetch the default model in the server process, before an engine child whose flags name
    no --pack / --native starts (the child then finds it in the cache)."""
    from strata import defaults

    opts = parse_engine_args(list(engine_args))
    if opts.pack is not None or opts.native is not None:
        return None
    return defaults.ensure_default_model(log)
