"""``dspark-router serve``: the gateway on uvicorn, over a router built from a config (the embedded default if none).

The server listens at once and loads the models in the background (/healthz is up, /readyz says 503 until they
are loaded). A server that cannot become ready is no use to anyone waiting on it, so when warm-up fails, or has
not finished within ``--workers-ready-timeout`` seconds, ``serve`` stops and exits with status 1, saying why.
"""

from __future__ import annotations

import argparse
import logging
import threading

log = logging.getLogger("uvicorn.error")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="router YAML (default: the embedded two-pool config on the default model)")
    p.add_argument("--host", help="address to listen on (default: the config's gateway.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default: the config's gateway.port, 8000)")
    p.add_argument(
        "--workers-ready-timeout",
        type=float,
        metavar="S",
        help="seconds the pools may take to load their models before serve gives up (default: gateway's, 600)",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from router.gateway.app import create_app
    from router.sdk import Router

    router = Router.from_config(args.config)
    overrides = {"host": args.host, "port": args.port, "workers_ready_timeout_s": args.workers_ready_timeout}
    settings = router.config.gateway.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    app = create_app(router, settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=args.log_level,
            access_log=args.log_level in ("info", "debug"),
            timeout_graceful_shutdown=10,
        )
    )
    failed: list[str] = []

    def watch_warmup() -> None:
        readiness = app.state.gateway.readiness
        if readiness.wait(settings.workers_ready_timeout_s):
            log.info("dspark-router is ready: pools %s", ", ".join(router.pools))
            return
        failed.append(readiness.problem() or "not ready")
        if "loading" in failed[0]:
            failed[0] = f"the models did not load within {settings.workers_ready_timeout_s:g}s"
        log.error("dspark-router cannot serve (%s); stopping", failed[0])
        server.should_exit = True

    threading.Thread(target=watch_warmup, name="gateway-ready-watch", daemon=True).start()
    try:
        server.run()
    finally:
        router.close()
    return 1 if failed else 0
