"""The shared pieces of every benchmark entry point in benchmarks/.

- `timer`: interleaved timing (warm-up, rotation, min / median / spread) and request timing (a call end to end;
  a streamed request's time to its first token and the gaps after it; token-weighted time per output token);
- `record`: the run record (git commit and dirty flag, CPU, cores and threads, package versions, each system's
  settings, the command line), where a run's files go (`benchmarks/results/<experiment>/<date>-<commit>/`), and
  `finish`, the tail every entry point ends with (its tables, record.json, and where they went);
- `opening`: models are opened through `specdec.load` only, so a benchmark measures what a user gets (the native
  backend's instruction set and weight pages chosen per opening: `native_env`);
- `tables`: markdown and CSV writers (one format per table; a CSV only where a plot or a page reads it).

The entry points import it as `harness` (Python puts a script's own folder first on sys.path).
"""
