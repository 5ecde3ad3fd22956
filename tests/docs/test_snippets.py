"""The README's and the docs' runnable snippets, run as written against a tiny exported bundle, so they cannot rot.

Convention: a fenced block is run when the line before it is `<!-- runnable -->` (or `<!-- runnable: server -->`,
run while `specdec serve` serves the tiny bundle as `smollm2-q41` with the key `my-key`). ```python blocks run with
the project's interpreter; other blocks run line by line in bash (`set -e`). Substituted before running:
`bundles/smollm2-q41` -> the tiny gqa bundle; any other `bundles/NAME` -> a scratch folder; `path/to/hf_dir` -> the
tiny model's directory; `bench-results` -> a scratch folder; `http://127.0.0.1:8000` -> the test server.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [p for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md") if p.is_file()]
PAGES += sorted((ROOT / "docs").rglob("*.md"))
MARK = re.compile(r"^<!-- runnable(?:: (?P<kind>server))? -->\n```(?P<lang>\w*)\n(?P<code>.*?)^```", re.M | re.S)


def snippets() -> list:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in MARK.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            found.append(pytest.param(match["lang"], match["code"], match["kind"] or "",
                                      id=f"{page.relative_to(ROOT)}:{line}"))
    return found


def substitute(code: str, bundle: Path, model: Path, scratch: Path, url: str) -> str:
    code = re.sub(r"bundles/smollm2-q41\b", str(bundle), code)
    code = re.sub(r"(?<![\w/.-])bundles/", f"{scratch}/bundles/", code)
    code = code.replace("path/to/hf_dir", str(model)).replace("http://127.0.0.1:8000", url)
    return re.sub(r"(?<![\w/.-])bench-results\b", str(scratch / "bench-results"), code)


def environment() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # specdec, specdec-export
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("SPECDEC_API_KEY", None)
    return env


def run(lang: str, code: str, cwd: Path) -> subprocess.CompletedProcess:
    if lang == "python":
        command = [sys.executable, "-c", code]
    else:
        command = ["bash", "-c", "set -euo pipefail\n" + code]
    return subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def server(gqa_int4_bundle, tmp_path_factory):
    """`specdec serve` on the tiny bundle, named as the docs' examples name the default bundle."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("server") / "log.txt"
    with log.open("w") as handle:
        process = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", str(gqa_int4_bundle), "--port",
                                    str(port), "--model-name", "smollm2-q41", "--api-key", "my-key"], cwd=ROOT,
                                   env=environment(), stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_there_are_runnable_snippets_on_the_pages_a_user_reads_first():
    ids = [p.id for p in snippets()]
    for page in ("README.md", "docs/getting-started.md", "docs/generation.md", "docs/serving.md"):
        assert any(i.startswith(page + ":") for i in ids), f"{page} has no runnable snippet"


@pytest.mark.parametrize("lang, code, kind", snippets())
def test_snippet_runs(lang, code, kind, gqa_int4_bundle, tiny_llama, tmp_path, request):
    url = request.getfixturevalue("server") if kind == "server" else "http://127.0.0.1:9"
    done = run(lang, substitute(code, gqa_int4_bundle, tiny_llama, tmp_path, url), ROOT)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"
