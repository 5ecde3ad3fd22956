"""Running the app under uvicorn: in the foreground (`specdec serve`) or on a background thread (tests, the load
benchmark), always on the host the options name (127.0.0.1 unless told otherwise)."""
from __future__ import annotations

import threading
import time

from specdec.errors import BackendError, missing_dependency
from specdec.serving.options import ServeOptions


def _uvicorn():
    try:
        import uvicorn
    except ImportError as exc:
        raise missing_dependency("uvicorn", "serve") from exc
    return uvicorn


def _config(options: ServeOptions, app):
    return _uvicorn().Config(app, host=options.host, port=options.port, log_level="warning", access_log=False,
                             timeout_graceful_shutdown=5, lifespan="on")


def serve(options: ServeOptions) -> None:
    """Serve until interrupted. The bundle is loaded first, so a bad bundle fails here with its SpecDecError."""
    from specdec.serving.app import build_app
    from specdec.serving.engine import Engine

    server = _uvicorn()
    engine = Engine.from_options(options).start()
    try:
        server.Server(_config(options, build_app(options, engine))).run()
    finally:
        engine.close()


class BackgroundServer:
    """`with BackgroundServer(options) as server: server.url` — uvicorn on a thread, stopped on exit. Port 0 picks a
    free port. `app` is built from the options unless given."""

    def __init__(self, options: ServeOptions, app=None, start_timeout_s: float = 120.0):
        self.options = options
        self.app = app
        self.start_timeout_s = start_timeout_s
        self.server = None
        self.thread = None

    def __enter__(self) -> "BackgroundServer":
        from specdec.serving.app import build_app

        self.app = self.app or build_app(self.options)
        self.server = _uvicorn().Server(_config(self.options, self.app))
        self.thread = threading.Thread(target=self.server.run, name="specdec-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.__exit__()
                raise BackendError("the server did not start", "run `specdec serve -v` to see why")
            time.sleep(0.05)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
