"""An installed wheel runs the default path: `pip wheel .` carries the native engine's C sources, and a fresh venv
with that wheel (and no onnx) opens a Q4_1 bundle on native, compiling the sources on first use; `auto` generates
there, and on onnxruntime with SPECDEC_BACKEND=onnxruntime.

The fresh venv gets specdec from the wheel only. Its dependencies are the ones already installed here, offered
through a folder of links to exactly those distributions (numpy, tokenizers, jinja2, tqdm, onnxruntime and what they
import), so the test needs no network and onnx is really absent."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from specdec.native import build

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")]
ROOT = Path(__file__).resolve().parents[2]
DEPENDENCIES = ("numpy", "tokenizers", "huggingface_hub", "jinja2", "markupsafe", "tqdm", "onnxruntime", "flatbuffers",
                "packaging", "protobuf", "sympy", "mpmath", "coloredlogs", "humanfriendly", "filelock", "fsspec",
                "pyyaml", "requests", "typing_extensions", "charset_normalizer", "idna", "urllib3", "certifi",
                "hf_xet", "httpx", "httpcore", "anyio", "sniffio", "h11", "shellingham", "typer", "click", "rich",
                "markdown_it_py", "mdurl", "pygments")
SCRIPT = """
import os, sys, importlib.util
import specdec
assert specdec.__file__.startswith(sys.prefix), specdec.__file__
assert importlib.util.find_spec("onnx") is None
bundle = sys.argv[1]
config = specdec.GenerationConfig(max_new_tokens=8, drafter="model")
with specdec.load(bundle, backend="native") as gen:
    native = gen.generate("The quick brown fox", config).token_ids
with specdec.load(bundle) as gen:
    print("AUTO", gen.backend, gen.backend_note)
    assert gen.generate("The quick brown fox", config).token_ids == native
print("NATIVE", native)
"""


def _links(folder: Path) -> Path:
    """A folder of links to the installed DEPENDENCIES' top-level modules and metadata."""
    folder.mkdir()
    for name in DEPENDENCIES:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists() and top not in ("__pycache__", "bin"):
                (folder / top).symlink_to(source)
    return folder


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(work / "dist")], check=True, capture_output=True, timeout=600)
    wheel = next((work / "dist").glob("specdec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for path in build.SOURCES + build.HEADERS:
        assert f"specdec/native/{path.name}" in names
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=600)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "dependencies.pth").write_text(str(_links(work / "deps")) + "\n", encoding="utf-8")
    return python, work


def test_a_wheel_in_a_fresh_venv_runs_native_without_onnx(fresh_venv, q41_bundle):
    python, work = fresh_venv
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "SPECDEC_CACHE": str(work / "cache")}
    done = subprocess.run([str(python), "-c", SCRIPT, str(q41_bundle)], capture_output=True, text=True, cwd=work,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "AUTO native None" in done.stdout
    assert list((work / "cache").rglob("libspecdec_native.so"))  # compiled from the wheel's sources
    off = subprocess.run([str(python), "-c", SCRIPT.replace('backend="native"', 'backend="auto"'), str(q41_bundle)],
                         capture_output=True, text=True, cwd=work, env=dict(env, SPECDEC_BACKEND="onnxruntime"),
                         timeout=600)
    assert off.returncode == 0, off.stderr[-3000:]
    assert "AUTO onnxruntime the native backend did not open" in off.stdout
