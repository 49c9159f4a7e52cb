"""The engine's app and the `strata serve` proxy serve the same routes, both built from one table
(strata/server/routes.py, ROUTES): no route is declared a second time. Built, not served: no
engine starts."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute

from strata.server.app import create_app
from strata.server.config import ServerConfig
from strata.server.proxy import ServeApp
from strata.server.routes import ADMIT, KEY_EXEMPT, LOCAL, PASS, ROUTES, add_routes
from strata.server.supervisor import Supervisor


def _served(app) -> set[tuple[str, str, str]]:
    return {(method, r.path, r.name) for r in app.routes if isinstance(r, APIRoute) for method in r.methods}


TABLE = {(r.method, r.path, r.name) for r in ROUTES}


def test_the_engine_app_serves_the_table():
    assert _served(create_app()) == TABLE


def test_the_proxy_serves_the_table():
    assert _served(ServeApp(Supervisor(ServerConfig())).app) == TABLE


def test_the_table_is_well_formed():
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)
    assert len({r.name for r in ROUTES}) == len(ROUTES)
    assert {r.proxy for r in ROUTES} <= {ADMIT, PASS, LOCAL}
    # a body is checked where it comes in, on both sides: every POST names its request model
    assert all((r.body is not None) == (r.method == "POST") for r in ROUTES)
    assert KEY_EXEMPT == {"/health"}


def test_a_handler_table_must_match_the_routes():
    from fastapi import FastAPI

    async def h():
        return {}

    with pytest.raises(AssertionError, match="metrics"):
        add_routes(FastAPI(), {r.name: h for r in ROUTES if r.name != "metrics"})
