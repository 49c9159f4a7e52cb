"""The `strata` dispatcher: command table, engine shorthand, error and interrupt exits."""

import subprocess
import sys
from pathlib import Path


from strata.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]


def _strata(*args):
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_usage_lists_commands():
    proc = _strata("--help")
    assert proc.returncode == 0
    for name in ("generate", "tokenize", "inspect", "kernels", "probe", "pack", "serve", "engine", "mtp"):
        assert name in proc.stdout
    assert _strata().returncode == 2


def test_unknown_command():
    proc = _strata("frobnicate")
    assert proc.returncode == 2 and proc.stderr.startswith("strata: unknown command 'frobnicate'")


def test_bad_flag_is_one_line():
    proc = _strata("inspect", "--no-such-flag")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "--no-such-flag" in proc.stderr


def _fake_command(tmp_path, monkeypatch, body):
    """A real command module on disk, registered in the dispatcher's table."""
    module = f"strata_fake_cmd_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(
        "def add_arguments(p):\n    p.add_argument('--x')\n\ndef run(args):\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli_main.COMMANDS, "fake", (module, "test"))
    monkeypatch.setattr(cli_main, "DEFAULT_COMMAND", "fake")


def test_flag_first_goes_to_default_command(tmp_path, monkeypatch, capsys):
    _fake_command(tmp_path, monkeypatch, "    print('got', args.x)\n    return 0\n")
    assert cli_main.main(["--x", "7"]) == 0
    assert capsys.readouterr().out.strip() == "got 7"


def test_keyboard_interrupt_exits_130(tmp_path, monkeypatch):
    _fake_command(tmp_path, monkeypatch, "    raise KeyboardInterrupt\n")
    assert cli_main.main(["fake"]) == 130


def test_unavailable_command(monkeypatch, capsys):
    monkeypatch.setitem(cli_main.COMMANDS, "ghost", ("strata.cli.ghost_not_built", "test"))
    assert cli_main.main(["ghost"]) == 2
    assert capsys.readouterr().err.strip() == "strata: command ghost is not available in this build"
