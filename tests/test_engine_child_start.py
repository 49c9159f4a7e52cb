"""How the engine child starts: nothing of the folder `strata serve` runs in is imported by it
(the child runs with a safe path in a fixed folder, relative paths resolved before), and
`strata engine` says it listens only when the socket is bound and its pack opened."""

from __future__ import annotations

import json
import subprocess
import sys

from support.model_fixtures import default_model_or_skip
from support.server_proc import HTTP, ROOT, StrataProcess

SHADOWS = ("queue", "json", "numpy")  # modules the engine imports, shadowed in the user's folder


def test_serve_imports_nothing_from_the_folder_it_runs_in(tmp_path):
    model = default_model_or_skip()
    marker = tmp_path / "imported.txt"
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n")
    (tmp_path / "model.gguf").symlink_to(model)
    (tmp_path / "serve.json").write_text(json.dumps({"parallel": 1, "args": ["--pack", "model.gguf",
                                                                            "--max-context", "256"]}))
    # -P: the server itself runs as the `strata` console script does (its script's folder on
    # sys.path, not the working directory); the engine child is what is looked at
    p = StrataProcess("serve", ["--config", "serve.json", "--port", "0"], cwd=tmp_path, python_flags=("-P",))
    try:
        p.wait_listening()
        p.wait_healthy()
        r = HTTP.post(p.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        p.kill_tree()
    assert not marker.exists(), f"imported from the working directory: {marker.read_text().split()}"


def test_a_pack_that_cannot_open_is_one_line_with_no_listening_line_before(tmp_path):
    missing = tmp_path / "nope"
    done = subprocess.run([sys.executable, "-m", "strata.cli.main", "engine", "--pack", str(missing), "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert (done.stdout + done.stderr).strip().splitlines() == [f"strata: pack {missing}: no such file or directory"]
