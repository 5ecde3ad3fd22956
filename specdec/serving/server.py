"""Running the app under uvicorn: in the foreground (`specdec serve`) or on a background thread (tests, the load
benchmark), always on the host the options name (127.0.0.1 unless told otherwise).

Connections are guarded (ConnectionGuard): a connection must send a request's headers within
`header_timeout_s` of opening or of its previous response, and its body within `body_timeout_s` of the headers;
idle keep-alive connections close after `keep_alive_s`, and at most `max_connections` are open at once (fewer where
the process's file limit is lower): at the cap, a new connection closes the oldest one still waiting for a request's
headers. So sockets that open and never finish a request's headers or body (slowloris) cannot lock other clients
out for longer than those timeouts. A stop (SIGTERM, Ctrl-C) drains the engine before uvicorn
closes the connections (DrainingServer): waiting requests get a 503, running ones `drain_s` seconds to finish, then
an error event; every stream ends with `[DONE]`.
"""
from __future__ import annotations

import asyncio
import threading
import time

from specdec.errors import BackendError, missing_dependency
from specdec.serving.options import ServeOptions

FD_RESERVE = 128  # file descriptors kept for the process itself (model files, pipes, the event loop) below its limit
SHUTDOWN_MARGIN_S = 5  # uvicorn's own graceful-shutdown timeout: the drain's grace plus this


def _uvicorn():
    try:
        import uvicorn
    except ImportError as exc:
        raise missing_dependency("uvicorn", "serve") from exc
    return uvicorn


def connection_cap(options: ServeOptions) -> int:
    """Open connections allowed at once: `max_connections`, and fewer where the process's open-file limit would
    run out first (an accept that fails for want of a descriptor stalls every client)."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # not POSIX: no limit to read
        return options.max_connections
    if limit == resource.RLIM_INFINITY:
        return options.max_connections
    return max(1, min(options.max_connections, limit - FD_RESERVE))


class ConnectionGuard:
    """The open connections of one server, oldest first, and the cap on them (see the module docstring)."""

    def __init__(self, cap: int, header_timeout_s: float, body_timeout_s: float = 30.0):
        self.cap = cap
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.open = {}  # protocol -> None, in the order the connections opened

    def opened(self, protocol) -> bool:
        """Admit a new connection, closing the oldest waiting one at the cap; False where it must be closed itself
        (every open connection is busy with a request)."""
        if len(self.open) >= self.cap:
            victim = next((p for p in self.open if waiting_for_request(p)), None)
            if victim is None:
                return False
            del self.open[victim]
            victim.transport.close()
        self.open[protocol] = None
        return True

    def closed(self, protocol) -> None:
        self.open.pop(protocol, None)


def waiting_for_request(protocol) -> bool:
    """Whether a uvicorn HTTP protocol has no request in progress: none started yet (its headers are not all in), or
    its last response is complete (an idle keep-alive connection)."""
    cycle = protocol.cycle
    return cycle is None or cycle.response_complete


def receiving_body(protocol) -> bool:
    """Whether a uvicorn HTTP protocol has a request's headers and waits for the rest of its body."""
    cycle = protocol.cycle
    return cycle is not None and not cycle.response_complete and cycle.more_body


def guarded_protocol(base: type, guard: ConnectionGuard) -> type:
    """uvicorn's HTTP protocol class `base` with `guard`'s cap, header timeout and body timeout."""

    class GuardedProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.idle_since = self.loop.time()
            if not guard.opened(self):
                transport.close()
                return
            self.loop.call_later(guard.header_timeout_s, self.check_headers)

        def connection_lost(self, exc) -> None:
            guard.closed(self)
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.idle_since = self.loop.time()

        def check_headers(self) -> None:
            """Close the connection if it has waited `header_timeout_s` for a request's headers, or
            `body_timeout_s` (from when a check first saw it waiting) for the rest of a body; else look again when
            it could have (a connection busy with a request: a header timeout later)."""
            if self.transport.is_closing():
                return
            now = self.loop.time()
            waited = now - self.idle_since
            if receiving_body(self):
                if getattr(self, "body_cycle", None) is not self.cycle:
                    self.body_cycle, self.body_since = self.cycle, now
                left = guard.body_timeout_s - (now - self.body_since)
                if left <= 0:
                    self.transport.close()
                else:
                    self.loop.call_later(min(left, guard.header_timeout_s), self.check_headers)
            elif not waiting_for_request(self):
                self.loop.call_later(guard.header_timeout_s, self.check_headers)
            elif waited >= guard.header_timeout_s:
                self.transport.close()
            else:
                self.loop.call_later(guard.header_timeout_s - waited, self.check_headers)

    return GuardedProtocol


def _server(options: ServeOptions, app):
    """A uvicorn server for `app` under the options' connection rules, which drains the app's engine on a stop."""
    uvicorn = _uvicorn()
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    guard = ConnectionGuard(connection_cap(options), options.header_timeout_s, options.body_timeout_s)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level="warning", access_log=False,
                            lifespan="on", timeout_keep_alive=options.keep_alive_s,
                            timeout_graceful_shutdown=int(options.drain_s) + SHUTDOWN_MARGIN_S,
                            http=guarded_protocol(AutoHTTPProtocol, guard))

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            for server in self.servers:  # no new connections while the engine drains
                server.close()
            engine = getattr(app.state, "engine", None)
            if engine is not None:
                await asyncio.to_thread(engine.drain, options.drain_s)
            await super().shutdown(sockets)

    return DrainingServer(config)


def serve(options: ServeOptions) -> None:
    """Serve until interrupted. The bundle is loaded and the prompt workers started first, in the calling thread, so
    a bad bundle fails here with its SpecDecError, and a SIGTERM (the CLI's Terminated) or Ctrl-C during the start-up
    ends it at once: what was started is stopped, and uvicorn never starts."""
    from specdec.serving.app import build_app
    from specdec.serving.engine import Engine
    from specdec.serving.prompts import PromptPool

    engine = Engine.from_options(options)
    prompts = None
    try:
        engine.start()
        prompts = PromptPool(engine.requests.root, options.prompt_budget).open()
        _server(options, build_app(options, engine, prompts=prompts)).run()
    finally:
        if prompts is not None:
            prompts.close()
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
        self.server = _server(self.options, self.app)
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
