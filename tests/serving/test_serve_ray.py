"""Scale-out on Ray Serve: a local Ray instance, 2 replicas of 1 CPU each behind Ray's proxy on 127.0.0.1.
Requests spread over both replicas; a replica killed under load is restarted by Ray while the service keeps
answering, every failed request gets a 5xx, and none hangs. Skipped only where the [ray] extra is missing."""
from __future__ import annotations

import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve")

from specdec.serving.options import ServeOptions  # noqa: E402
from specdec.serving.ray_app import APP_NAME, build_app  # noqa: E402
from tests.conftest import free_port  # noqa: E402

BODY = {"model": "gqa", "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}
TIMEOUT_S = 60.0  # a request still unanswered after this counts as hung



@pytest.fixture(scope="module")
def service(gqa_int4_bundle, tmp_path_factory):
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="specdec-test", _node_ip_address="127.0.0.1",
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = ServeOptions(bundle=str(gqa_int4_bundle), port=port, max_batch=2, max_queue=8)
        serve.run(build_app(options, replicas=2, cpus_per_replica=1), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _post(url: str) -> tuple[int, str | None]:
    """-> (status, replica); status 0 for a broken connection (counted as a failure, not a hang)."""
    try:
        response = httpx.post(url + "/v1/completions", json=BODY, timeout=TIMEOUT_S)
    except httpx.TimeoutException:
        return -1, None
    except httpx.TransportError:
        return 0, None
    return response.status_code, response.headers.get("x-specdec-replica")


def _running_replicas() -> int:
    status = serve.status().applications[APP_NAME].deployments["SpecdecReplica"]
    return status.replica_states.get("RUNNING", 0)


def test_requests_spread_over_both_replicas(service):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _post(service), range(16)))
    assert {status for status, _ in results} == {200}
    assert len({replica for _, replica in results}) == 2


def _replica_pids() -> set:
    handle = serve.get_app_handle(APP_NAME)
    pids = set()
    for _ in range(40):
        pids.add(handle.pid.remote().result(timeout_s=30))
        if len(pids) == 2:
            break
    return pids


def test_a_killed_replica_is_restarted_and_the_service_keeps_answering(service):
    pids = _replica_pids()
    assert len(pids) == 2
    with ThreadPoolExecutor(4) as pool:
        load = [pool.submit(_post, service) for _ in range(24)]
        time.sleep(0.5)
        os.kill(min(pids), signal.SIGKILL)
        during = [future.result() for future in load]
    statuses = [status for status, _ in during]
    assert -1 not in statuses, "a request hung"
    # a failure is a clean 5xx (0: a broken connection); the count of each, where one is not
    assert all(status == 200 or 500 <= status < 600 for status in statuses), Counter(statuses)
    assert statuses.count(200) >= len(statuses) // 2
    deadline = time.monotonic() + 120
    while _running_replicas() < 2 or len(_replica_pids() - pids) < 1:
        assert time.monotonic() < deadline, "Ray did not restart the replica"
        time.sleep(1)
    with ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda _: _post(service), range(16)))
    assert {status for status, _ in after} == {200}
    assert len({replica for _, replica in after}) == 2
