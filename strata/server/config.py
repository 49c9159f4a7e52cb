r"""`strata serve` configuration: JSON with comments, read into a pydantic model.

The file is JSON plus `//` and `/* */` comments and trailing commas. Comment markers inside
strings ("http://x") are text, not comments. Windows paths are accepted as users write
them: "C:\\models\\x" (proper JSON) and also "C:\models\x" (raw backslashes, which plain
JSON would reject).

Unknown keys are named in a warning; a bad value is one StrataError line naming the key.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from strata.engine.options import parse_engine_args
from strata.errors import StrataError

_VALID_ESCAPES = set('"\\/bfnrtu')
# "C:\x" with a single backslash after the drive: a raw Windows path
_RAW_DRIVE_PATH = re.compile(r"^[A-Za-z]:\\(?!\\)")

# engine flags whose values are paths; relative ones are taken from the config file's folder
PATH_FLAGS = ("--pack", "--mtp", "--ple-gguf", "--expert-profile")
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


def parse_jsonc(text: str, source: str = "config") -> Any:
    try:
        return json.loads(strip_jsonc(text))
    except json.JSONDecodeError as e:
        raise StrataError(f"{source}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


PositiveSeconds = Annotated[float, Field(gt=0)]


class ServerConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    parallel: Annotated[int, Field(ge=1)] | None = None
    args: list[str] = Field(default_factory=list)
    model: str | None = Field(default=None, validation_alias=AliasChoices("model", "alias", "model_name"))
    api_key: str | None = None
    max_queued: Annotated[int, Field(ge=0)] = 64
    request_timeout: Annotated[float, Field(ge=0)] = 600.0  # 0: no limit
    startup_timeout: PositiveSeconds = 600.0
    shutdown_timeout: Annotated[float, Field(ge=0)] = 30.0
    max_request_bytes: Annotated[int, Field(ge=1024)] = 16 * 1024 * 1024
    body_timeout: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 30.0  # 0: no limit
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
              "allowed_hosts", "allowed_origins", "access_log"}


def _describe(e: dict) -> str:
    loc = e["loc"]
    key = str(loc[0]) + "".join(f"[{p}]" for p in loc[1:] if isinstance(p, int))
    msg = e["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{key}: {msg} (got {e.get('input')!r})"


def _absolute_paths(args: list[str], base: Path) -> list[str]:
    out = list(args)
    for i, a in enumerate(out):
        flag, eq, val = a.partition("=")
        if flag not in PATH_FLAGS:
            continue
        if eq:
            if val and not _is_absolute(val):
                out[i] = f"{flag}={base / val}"
        elif i + 1 < len(out) and not _is_absolute(out[i + 1]) and not out[i + 1].startswith("--"):
            out[i + 1] = str(base / out[i + 1])
    return out


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
        cfg.args = _absolute_paths(cfg.args, base_dir)
    return cfg


def load_config(path: str | None, warn=None) -> ServerConfig:
    """Read a config file (None: all defaults, i.e. the bundled test model on 127.0.0.1:8080)."""
    if path is None:
        return ServerConfig()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise StrataError(f"config file {path} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"config file {path}: cannot read: {e}") from None
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
    from strata.mtp.draft import find_draft
    from strata.pack.loader import open_pack

    where = f"{source}: args: " if source else ""
    try:
        opts = parse_engine_args(list(cfg.args))
        pack_arg = opts.pack
        if pack_arg is None and opts.native is None:
            pack_arg = str(default_model_path())
        pack = open_pack(pack=pack_arg, native=opts.native, ple_gguf=opts.ple_gguf)
        try:
            pack.model_config()
            if opts.mtp is not None:
                find_draft(opts.mtp, pack)
        finally:
            pack.close()
    except StrataError as e:
        raise StrataError(f"{where}{e.message}") from None
