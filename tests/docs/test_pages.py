"""The README and the docs site: the generated performance page is current, the README is a short user guide without
dated narration, every error class has its troubleshooting entry, every path the pages cite exists, and the site
builds with `mkdocs build --strict` (where mkdocs is installed: the [docs] extra)."""
from __future__ import annotations

import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))]


def perf_page():
    spec = importlib.util.spec_from_file_location("make_perf_page", ROOT / "benchmarks" / "make_perf_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_performance_page_is_generated_from_the_committed_records():
    module = perf_page()
    committed = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert committed == module.render(), "docs/performance.md is stale: run python benchmarks/make_perf_page.py"
    assert all(module.plot_path(run).is_file() for run in module.bundle_runs("lockstep"))


def test_the_performance_page_lists_only_files_a_clone_has(tmp_path, monkeypatch):
    """A run folder may hold local copies git ignores (parquet); the page must read the same on a fresh clone."""
    module = perf_page()
    run = tmp_path / "lockstep" / "2026-01-01-abc1234"
    run.mkdir(parents=True)
    for name in ("record.json", "summary.csv", "summary.md", "summary.parquet", "requests.parquet"):
        (run / name).write_text("x", encoding="utf-8")
    (tmp_path / ".gitignore").write_text("# local copies\n*.parquet\n", encoding="utf-8")
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    assert [p.name for p in module.committed_files(run)] == ["summary.csv", "summary.md"]
    if shutil.which("git") and (ROOT / ".git").exists():
        monkeypatch.undo()
        for folder in (p for p in module.RESULTS.iterdir() if p.is_dir()):
            for real in module.runs(folder.name):
                tracked = subprocess.run(["git", "ls-files", "--", str(real)], cwd=ROOT, capture_output=True,
                                         text=True, check=True).stdout.split()
                if tracked:  # a run not committed yet lists what it has
                    names = sorted(Path(t).name for t in tracked if Path(t).parent == real.relative_to(ROOT))
                    assert [p.name for p in module.committed_files(real)] == [n for n in names if n != "record.json"]


def test_every_system_on_the_performance_page_has_its_settings_written():
    """A peer measured in several modes (lockstep's llama.cpp: settings["modes"]) gets what they share and a line per
    mode; no settings line is empty, least of all a peer's beside its headline numbers."""
    module = perf_page()
    settings = {"system": "llama.cpp", "threads": 2, "version": {"commit": "abc"},
                "flags": ["-t", "2"], "spec_type": "none"}
    lines = module.settings_lines("llama.cpp", {"modes": {"plain": settings, "ngram": settings | {
        "spec_type": "ngram-simple", "flags": ["-t", "2", "--spec-type", "ngram-simple"]}}})
    assert lines == ["- llama.cpp: system llama.cpp; threads 2",
                     "    - plain: flags ['-t', '2']; spec_type none",
                     "    - ngram: flags ['-t', '2', '--spec-type', 'ngram-simple']; spec_type ngram-simple"]
    assert module.settings_lines("x", {}) == ["- x: the record did not store them"]
    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert not re.search(r"^ *- [^`\n]+: *$", page, re.M), "a settings line with no settings"
    assert "- llama.cpp: system llama.cpp; model SmolLM2-135M-Instruct.Q4_1.gguf; threads 2;" in page


def test_the_readme_tables_are_the_newest_lockstep_run_of_each_bundle():
    module = perf_page()
    runs = module.bundle_runs("lockstep")
    assert runs and module.bundle_of(runs[0]) == module.DEFAULT_BUNDLE
    text = README.read_text(encoding="utf-8")
    for run in runs:
        assert module.readme_table(run) in text
        assert module.record_of(run)["git"]["short"] in text
        assert module.plot_path(run).relative_to(module.ROOT).as_posix() in text


def test_runs_are_ordered_by_their_start_not_by_their_folder_name():
    module = perf_page()
    for experiment in ("lockstep", "llamacpp-sweep"):
        found = module.runs(experiment)
        started = [module.record_of(run).get("started") for run in found]
        assert started[-1] == max(s for s in started if s)  # the newest is the one that started last
        assert len({run.name[:10] for run in found}) < len(found)  # folders of one day: their names do not tell


def test_the_readme_is_a_short_guide_without_dated_narration():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= 20 * 1024
    assert not re.search(r"20\d\d-[01]\d-[0-3]\d", text), "a date in the README"
    assert not re.search(r"(?<![\d.])[0-2]\d:[0-5]\d(?!\d)", text), "a time of day in the README"
    assert "lockstep-native" not in text and "DESIGN" not in text
    assert "make demo" in text and "make test" in text  # the two set-up commands (CI greps for them)


def test_no_page_points_at_a_design_file_outside_the_repository():
    for page in PAGES:
        assert not re.search(r"DESIGN(\.md| ?§)", page.read_text(encoding="utf-8")), page


def test_library_code_carries_no_dates_and_points_at_no_design_file_outside_the_repository():
    sources = [path for ext in ("py", "c", "h") for path in (ROOT / "specdec").rglob(f"*.{ext}")]
    assert len(sources) > 50
    for path in sources:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"20\d\d-[01]\d-[0-3]\d", text), f"a date in {path.relative_to(ROOT)}"
        assert not re.search(r"DESIGN(\.md| ?§)", text), f"{path.relative_to(ROOT)} points at DESIGN"


def test_every_error_class_has_a_troubleshooting_entry():
    from specdec import errors
    from specdec.serving import engine

    classes = {name for name, obj in inspect.getmembers(errors, inspect.isclass)
               if issubclass(obj, errors.SpecDecError) or obj is errors.Terminated}
    classes |= {"QueueFullError", "EngineClosedError"}
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    missing = [name for name in sorted(classes) if name not in text]
    assert not missing, f"docs/troubleshooting.md does not cover {missing}"
    assert issubclass(engine.QueueFullError, errors.SpecDecError)


def test_every_cited_path_exists():
    cited = re.compile(r"`((?:benchmarks|specdec|tests|docs)/[\w./-]+?)(?:::[\w]+)?`")
    for page in PAGES:
        for path in cited.findall(page.read_text(encoding="utf-8")):
            if any(mark in path for mark in ("<", "*", "NAME")):
                continue
            assert (ROOT / path).exists(), f"{page.relative_to(ROOT)} cites {path}, which does not exist"


@pytest.mark.skipif(shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (the [docs] extra)")
def test_the_site_builds_strict(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert len(built) >= 8 and "performance/index.html" in built and "reference/errors/index.html" in built


MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|Users)/[\w./-]+")


def test_no_record_or_page_holds_a_path_of_the_machine_that_made_it():
    """Records and pages name files relative to the repository (benchmarks/harness/record.py's repo_path), never by
    the absolute path of a checkout or a home folder."""
    files = [*ROOT.glob("benchmarks/results/**/*.json"), *ROOT.glob("benchmarks/results/**/*.md"), *PAGES,
             ROOT / "README.md"]
    found = {str(path.relative_to(ROOT)): MACHINE_PATH.findall(path.read_text(encoding="utf-8")) for path in files}
    assert not {name: paths for name, paths in found.items() if paths}
