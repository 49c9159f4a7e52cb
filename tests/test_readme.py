"""Every command in README.md runs, in order, as a new user would type it after the install.

The README's ```bash blocks are parsed into commands (one per line; `# ...` comments dropped);
a ```jsonc block whose first line is `// NAME` is written to the file NAME first. They run in
one scratch folder, in the order they appear:

- `strata serve ...` and `strata engine ...` start a real server (on a free port instead of the
  one they name), wait until it answers /health, get a chat answer over HTTP, and stop it;
  `curl` commands run against the server started last (its port put in), where curl exists;
- `pip install ...` is what the scratch environment already did: the rest of that line runs;
- the README's test command (`python3 -m pytest`) is this suite: not run again;
- every other command must exit 0.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from support.model_fixtures import default_model_or_skip
from support.server_proc import StrataProcess

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMAND_TIMEOUT_S = 180
SERVER_START_S = 180
SERVERS = ("serve", "engine")


@dataclass
class Step:
    kind: str  # "run", "file"
    text: str  # the command, or the file's content
    name: str = ""  # the file's name
    line: int = 0  # where in README.md


def readme_steps(text: str) -> list[Step]:
    steps: list[Step] = []
    for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.M | re.S):
        lang, body = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start()) + 2
        if lang == "jsonc":
            first = body.split("\n", 1)[0].strip()
            if first.startswith("// ") and "." in first:
                steps.append(Step("file", body, first[3:].strip(), line))
        elif lang == "bash":
            for i, raw in enumerate(body.splitlines()):
                cmd = re.split(r"\s+#\s", " " + raw, maxsplit=1)[0].strip()
                if cmd and not cmd.startswith("#"):
                    steps.append(Step("run", cmd, line=line + i))
    return steps


def _strata(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "strata", *args]


def _argv(cmd: str) -> list[str] | None:
    """The argv of one command; None for what this suite stands for (pip, the test command)."""
    words = shlex.split(cmd)
    if words[:2] == ["pip", "install"] or words[:1] == ["python3"] and "pytest" in words:
        return None
    if words[0] == "strata":
        return _strata(words[1:])
    return words


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def serve_and_chat(argv: list[str], cwd: Path, where: str) -> StrataProcess:
    """Start the README's server command on a free port, wait until it is healthy and answers
    a chat request."""
    server = StrataProcess(argv[3], [*argv[4:], "--port", "0"], cwd=cwd)
    try:
        server.wait_listening(SERVER_START_S)
        server.wait_healthy(SERVER_START_S)
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, (where, r.text)
    except BaseException:
        server.kill_tree()
        raise
    return server


def test_the_readme_has_the_two_commands_first():
    steps = [s for s in readme_steps(README.read_text(encoding="utf-8")) if s.kind == "run"]
    assert "strata serve" in steps[0].text and steps[0].text.startswith("pip install"), steps[0].text
    assert "pytest" in steps[1].text, steps[1].text
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = steps[1].text.replace("pip install", "python3 -m pip install -q")
    assert test_command in ci, f".ci/run must run the README's test command: {steps[1].text}"


def test_every_readme_command_runs(tmp_path):
    default_model_or_skip()
    work = tmp_path / "fresh"
    work.mkdir()
    last: StrataProcess | None = None
    try:
        for step in readme_steps(README.read_text(encoding="utf-8")):
            where = f"README.md:{step.line}: {step.text[:100]}"
            if step.kind == "file":
                (work / step.name).write_text(step.text, encoding="utf-8")
                continue
            for part in [p.strip() for p in step.text.split("&&")]:
                argv = _argv(part)
                if argv is None:
                    continue
                if argv[:3] == _strata([])[:3] and argv[3] in SERVERS:
                    if last is not None:
                        last.kill_tree()
                    last = serve_and_chat(argv, work, where)
                    continue
                if argv[0] == "curl":
                    if shutil.which("curl") is None:
                        continue
                    assert last is not None and last.proc.poll() is None, f"{where}: no server is running"
                    argv = [re.sub(r"http://127\.0\.0\.1:\d+", last.url, a) for a in argv]
                    argv = [argv[0], "--fail", "--silent", "--show-error", *argv[1:]]
                r = subprocess.run(argv, cwd=work, env=_env(), capture_output=True, text=True,
                                   timeout=COMMAND_TIMEOUT_S)
                assert r.returncode == 0, f"{where}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    finally:
        if last is not None:
            last.kill_tree()
