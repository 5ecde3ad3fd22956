"""The shared pieces of every benchmark entry point in benchmarks/.

- `timer`: interleaved timing (warm-up, rotation, min / median / spread);
- `record`: the run record (git commit and dirty flag, CPU, cores and threads, package versions, each system's
  settings, the command line) and where a run's files go (`benchmarks/results/<experiment>/<date>-<commit>/`);
- `opening`: models are opened through `specdec.load` only, so a benchmark measures what a user gets;
- `tables`: markdown and CSV writers (one format per table; a CSV only where a plot or a page reads it).

The entry points import it as `harness` (Python puts a script's own folder first on sys.path).
"""
