"""`strata serve [--config FILE] [--host H] [--port P]`: the OpenAI-compatible server, which
runs `strata engine` as a supervised child process. Without a config it serves the bundled
test model (SmolLM2-135M-Instruct) on 127.0.0.1:8080."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from strata.engine.options import name_list, port_number

    parser.add_argument("--config", help="JSON config (comments allowed); see docs/SERVER.md")
    parser.add_argument("--host", help="listen address (overrides the config)")
    parser.add_argument("--port", type=port_number, help="listen port (overrides the config; 0 picks a free port)")
    parser.add_argument("--allowed-hosts", type=name_list, metavar="H1,H2",
                        help="Host names served (overrides the config's allowed_hosts; '*': any)")
    parser.add_argument("--allowed-origins", type=name_list, metavar="O1,O2",
                        help="web origins allowed besides loopback pages (overrides allowed_origins; '*': any)")
    parser.add_argument("--header-timeout", type=float, metavar="S",
                        help="seconds a connection may take to send its request head (overrides header_timeout)")
    parser.add_argument("--max-connections", type=int, metavar="N",
                        help="connections held open at most; more get 503 (overrides max_connections)")
    parser.add_argument("--no-access-log", action="store_true",
                        help="no access-log line per request (overrides the config's access_log)")


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from strata.server.config import check_engine_start, load_config, with_overrides
    from strata.server.engine_launch import launch_first

    cfg = with_overrides(load_config(args.config, warn=_warn), host=args.host, port=args.port,
                         allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                         access_log=False if args.no_access_log else None,
                         header_timeout=args.header_timeout, max_connections=args.max_connections)
    check_engine_start(cfg, args.config)  # a missing pack or a bad flag: one line, before any engine starts
    # The first engine starts now and loads its model while the web stack below is imported; it
    # leaves by itself if this process does (it watches its stdin, a pipe from here).
    first = launch_first(cfg.args, cfg.engine_parallel(), cfg.model)
    try:
        from strata.server.proxy import run_server

        return run_server(cfg, first=first)
    finally:
        if not first.adopted:  # the server failed before it took the engine over (e.g. its port)
            first.proc.kill()
