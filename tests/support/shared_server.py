"""One `strata serve` (its engine child, the test model on the CPU) shared by the end-to-end
modules whose tests need only "a server with the key, two slots and a context of N_CTX":
tests/test_server_hostile.py, test_server_openai.py, test_server_routes.py,
test_server_sampling_fields.py, test_server_tools.py, test_cache_scope.py,
test_content_specials.py and test_route_privacy.py. Each used to start its own of nearly
the same config (~4 s each, and the first generation on a new engine is slower again).

None of their tests depends on being alone on it: none restarts or stops the engine or changes
a setting; the /metrics checks are lower bounds, never counts from zero; those that look at
the slots (test_server_routes' and test_route_privacy's /slots, test_server_openai's
disconnect) wait for them to be idle, and every other test's requests have ended when it
returns (modules run one at a time); test_cache_scope's prompts carry a tag of their own run;
the prompt that test_server_sampling_fields expects to find uncached is its own; log lines are
looked for after the requests that write them (test_server_routes' access lines,
test_server_hostile's "internal error"); test_server_openai's check of the config's warning
reads the start-up lines, which this CONFIG holds for it.

A module takes the server with `server = shared_server.module_fixture(__name__)`. It is started
by the first module that asks, and stopped after the last test of the session's last module
that uses it (or at the end of the session, whichever comes first)."""

from __future__ import annotations

import pytest

from support.server_proc import StrataProcess, serving

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "smol"  # the served name
N_CTX = 512  # the largest prompt of the modules is ~260 tokens (test_server_tools' two tools)
BODY_TIMEOUT_S = 1.0  # test_server_hostile's bodies that never arrive are answered 408 after it
# JSON with comments, as users write it, and an unknown key (test_server_openai checks both)
CONFIG = f"""// JSON with comments, as users write it
{{
  "parallel": 2,
  "model": "{MODEL}",          /* the served name */
  "api_key": "{KEY}",
  "max_queued": 8,
  "body_timeout": {BODY_TIMEOUT_S},
  "args": ["--max-context", "{N_CTX}"],
  "homepage": "http://example.com/x",   // unknown key: a warning, not a failure
}}
"""

_USERS: set[str] = set()  # the modules that use it
_state: dict = {}  # "server": the StrataProcess, "cm": its serving() context


def _stop() -> None:
    cm = _state.pop("cm", None)
    _state.pop("server", None)
    if cm is not None:
        cm.__exit__(None, None, None)


def _server(request) -> StrataProcess:
    p = _state.get("server")
    if p is not None and p.proc.poll() is None:
        return p
    _stop()  # (a server that exited: start another)
    cm = serving(request.getfixturevalue("tmp_path_factory").mktemp("shared-serve"), CONFIG)
    p = cm.__enter__()
    _state.update(server=p, cm=cm)
    if not _state.get("cleanup"):
        _state["cleanup"] = True
        request.config.add_cleanup(_stop)
    return p


def _used_later(request) -> bool:
    """Whether a test after this module's last one, in a module that uses the server, runs."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if getattr(item, "module", None) is request.module]
    later = items[max(mine) + 1:] if mine else []
    return any(getattr(getattr(item, "module", None), "__name__", None) in _USERS for item in later)


def module_fixture(module_name: str):
    """The module-scoped `server` fixture of a module that uses the shared server."""
    _USERS.add(module_name)

    @pytest.fixture(scope="module", name="server")
    def server(request):
        yield _server(request)
        if not _used_later(request):
            _stop()

    return server
