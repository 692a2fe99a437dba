"""The monitor's HTTP side: a bottle app with the page (`/`), its live content (`/fragment`), the data
as JSON (`/api/swarm`) and Prometheus metrics (`/metrics`), served by a threaded WSGI server.

bottle is one pure-Python module with no dependencies, maintained since 2009: routing and response
headers are all these four routes need. It runs on the standard library's WSGI server, so the monitor
adds no event loop of its own next to hivemind's, and binding the port is ours to turn into a clear
error when it is taken.
"""

from __future__ import annotations

import errno
import json
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import bottle

from swarmtrain.config.errors import UserError
from swarmtrain.monitor.history import SwarmHistory
from swarmtrain.monitor.page import PageMeta, render_content, render_page
from swarmtrain.monitor.prometheus import CONTENT_TYPE, render_metrics
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)


def build_app(history: SwarmHistory, meta: PageMeta) -> bottle.Bottle:
    app = bottle.Bottle()

    @app.get("/")
    def page():
        bottle.response.content_type = "text/html; charset=utf-8"
        return render_page(history.view(), meta)

    @app.get("/fragment")
    def fragment():
        bottle.response.content_type = "text/html; charset=utf-8"
        bottle.response.set_header("Cache-Control", "no-store")
        return render_content(history.view(), meta)

    @app.get("/api/swarm")
    def api():
        bottle.response.content_type = "application/json"
        body = {**history.view(), "source": meta.source, "simulated": meta.simulated}
        return json.dumps(body, allow_nan=False)  # view() is JSON-safe: a NaN here is a bug, not data

    @app.get("/metrics")
    def metrics():
        bottle.response.content_type = CONTENT_TYPE
        return render_metrics(history.view())

    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a browser holding a connection never keeps the monitor from exiting


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        logger.debug("%s " + format, self.address_string(), *args)  # not one stderr line per request


def start_http_server(app, host: str, port: int) -> WSGIServer:
    """Bind `host:port` (0: any free port) or raise a UserError that says what to change."""
    try:
        return make_server(host, port, app, server_class=_ThreadingServer, handler_class=_QuietHandler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UserError(
                f"port {port} on {host} is already in use; choose another --port (0 picks a free one)"
            ) from None
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def server_url(server: WSGIServer, host: str) -> str:
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else host
    return f"http://{shown}:{server.server_port}/"
