"""`strata serve` config: JSON with comments, pydantic validation, one-line errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from strata.errors import StrataError
from strata.server.config import config_from_dict, load_config, parse_jsonc, with_overrides
from support.server_proc import ROOT

SEED = """{ "parallel": 4, "args": ["--pack", "packs/iq3_s", "--mtp", "mtp/rt", "--spec", "4", "--spec-min-p", "0.5",
  "--batch-mtp", "--expert-cache", "auto", "--prefill", "auto:32768", "--max-context", "262144", "--kv", "int8"] }"""


def test_comments_outside_strings_only():
    text = r'''{
      // line comment with "quotes" and /* a block opener
      "url": "http://example.com//path/*not a comment*/", /* block
      comment over lines */ "n": 3,
      "list": [1, 2,],   // trailing commas are forgiven
    }'''
    assert parse_jsonc(text) == {"url": "http://example.com//path/*not a comment*/", "n": 3, "list": [1, 2]}


def test_json_errors_keep_the_file_line():
    with pytest.raises(StrataError, match=r"c.json: not valid JSON: .* line 4"):
        parse_jsonc('{\n// one\n/* two\n*/ "a": 1 "b": 2}', "c.json")


@pytest.mark.parametrize("raw,path", [
    (r'"C:\\models\\pack"', "C:\\models\\pack"),        # proper JSON escapes
    (r'"C:\models\pack"', "C:\\models\\pack"),          # raw backslashes, as typed on Windows
    (r'"C:\new\table"', "C:\\new\\table"),              # \n \t would be escapes in plain JSON
    (r'"\\server\share\x"', "\\\\server\\share\\x"),    # a raw UNC path
    (r'"C:/models/pack"', "C:/models/pack"),
])
def test_windows_paths(raw, path):
    assert parse_jsonc('{"args": ["--pack", %s]}' % raw)["args"][1] == path


def test_seed_config_loads_with_paths_from_the_config_folder(tmp_path):
    f = tmp_path / "seed.json"
    f.write_text(SEED)
    cfg = load_config(str(f))
    assert cfg.engine_parallel() == 4
    assert cfg.args[cfg.args.index("--pack") + 1] == str(tmp_path.resolve() / "packs/iq3_s")
    assert cfg.args[cfg.args.index("--mtp") + 1] == str(tmp_path.resolve() / "mtp/rt")
    assert cfg.args[cfg.args.index("--kv") + 1] == "int8"


def test_absolute_and_windows_paths_stay(tmp_path):
    cfg = config_from_dict({"args": ["--pack", "/abs/p", "--mtp=D:\\m"]}, base_dir=tmp_path)
    assert cfg.args == ["--pack", "/abs/p", "--mtp=D:\\m"]


def test_shard_names_go_to_the_pack_folder_when_there_else_to_the_config_folder(tmp_path):
    pack = tmp_path / "packs" / "iq3_s"
    pack.mkdir(parents=True)
    (pack / "M-00001-of-00002.gguf").write_bytes(b"")
    args = ["--pack", "packs/iq3_s", "--native", "M-00001-of-00002.gguf", "--ple-gguf=M-00002-of-00002.gguf"]
    cfg = config_from_dict({"args": args}, base_dir=tmp_path)
    assert cfg.args == ["--pack", str(pack), "--native", str(pack / "M-00001-of-00002.gguf"),
                        f"--ple-gguf={tmp_path / 'M-00002-of-00002.gguf'}"]  # not in the pack folder


def test_defaults_serve_the_bundled_model_on_localhost():
    cfg = load_config(None)
    assert (cfg.host, cfg.port, cfg.args, cfg.engine_parallel()) == ("127.0.0.1", 8080, [], 1)


def test_unknown_keys_warn_and_aliases_work():
    warnings: list[str] = []
    cfg = config_from_dict({"alias": "m", "colour": "blue", "zzz": 1}, "c.json", warn=warnings.append)
    assert cfg.model == "m"
    assert warnings == ["strata: warning: c.json: unknown key(s) ignored: colour, zzz"]


@pytest.mark.parametrize("data,words", [
    ({"parallel": "four"}, "c.json: parallel: Input should be a valid integer (got 'four')"),
    ({"parallel": 0}, "c.json: parallel: Input should be greater than or equal to 1"),
    ({"port": 70000}, "c.json: port:"),
    ({"args": "--spec 4"}, "c.json: args: Input should be a valid list"),
    ({"args": ["--spec", 4]}, "c.json: args[1]: Input should be a valid string"),
    ({"args": ["--bogus"]}, "c.json: args: bad engine flag: unrecognized arguments: --bogus"),
    ({"args": ["--kv", "int4"]}, "c.json: args: bad engine flag: argument --kv"),
    ({"max_queued": -1}, "c.json: max_queued:"),
    ({"api_key": 5}, "c.json: api_key:"),
    ({"startup_timeout": 0}, "c.json: startup_timeout:"),
])
def test_bad_values_name_the_key(data, words):
    with pytest.raises(StrataError) as e:
        config_from_dict(data, "c.json")
    assert words in e.value.message and "\n" not in e.value.message


def test_command_line_overrides_are_validated():
    cfg = with_overrides(load_config(None), host="0.0.0.0", port=0)
    assert (cfg.host, cfg.port) == ("0.0.0.0", 0)
    with pytest.raises(StrataError, match="command line: port"):
        with_overrides(cfg, port=-5)


def test_flags_set_by_serve_are_warned_about():
    warnings: list[str] = []
    config_from_dict({"args": ["--port", "9000"]}, "c.json", warn=warnings.append)
    assert any("--port is set by strata serve" in w for w in warnings)


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path: Path):
    f = tmp_path / "bad.json"
    f.write_text('{"parallel": -3}')
    r = _serve("--config", str(f))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"strata: {f}: parallel: Input should be greater than or equal to 1 (got -3)"]
    r = _serve("--config", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _strata(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_engine_refusals_are_one_line_exit_2(tmp_path: Path):
    r = _strata("engine", "--bogus-flag", "1")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--bogus-flag" in r.stderr
    r = _strata("--spec", "many")  # `strata --flag` is `strata engine --flag`
    assert r.returncode == 2 and "--spec" in r.stderr
    missing = tmp_path / "nope"
    r = _strata("--pack", str(missing), "--port", "0")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == f"strata: pack {missing}: no such file or directory"
