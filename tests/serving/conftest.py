"""Servers for the serving tests: the real app under uvicorn on 127.0.0.1 (a free port), on tiny exported bundles.
Skipped only where the [serve] extra is not installed (`make test` installs it)."""
from __future__ import annotations

import re
import time
from contextlib import contextmanager

import pytest

for _module in ("fastapi", "uvicorn", "openai", "prometheus_client", "httpx"):
    pytest.importorskip(_module, reason="the [serve] extra is not installed: pip install -e '.[serve]'")

import openai  # noqa: E402

from specdec.serving.app import build_app  # noqa: E402
from specdec.serving.engine import Engine  # noqa: E402
from specdec.serving.options import ServeOptions  # noqa: E402
from specdec.serving.server import BackgroundServer  # noqa: E402

KEY = "test-key-0123456789"


def start(bundle, **options) -> BackgroundServer:
    return BackgroundServer(ServeOptions(bundle=str(bundle), port=0, **options))


class SlowEngine(Engine):
    """The real engine with a pause before every round: a tiny model decodes ~5000 tokens/s, faster than a test
    can act on a stream."""

    pause_s = 0.05

    def _round(self) -> None:
        time.sleep(self.pause_s)
        super()._round()


@contextmanager
def start_slow(bundle, **options):
    options = ServeOptions(bundle=str(bundle), port=0, **options)
    engine = SlowEngine.from_options(options).start()
    try:
        with BackgroundServer(options, app=build_app(options, engine)) as server:
            yield server
    finally:
        engine.close()


def client(server: BackgroundServer, key: str = KEY, timeout: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=timeout)


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus exposition: metric('...', 'specdec_requests_total', 'status="success"')."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" ([0-9.e+-]+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else float("nan")
