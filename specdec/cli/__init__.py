"""The command-line layer: `specdec` and `specdec-export`. It composes the library's parts (export, then
quantize; export, then build engines) and turns a SpecDecError into `error:` + `Hint:` with no traceback."""
from specdec.cli.main import export_main, main

__all__ = ["main", "export_main"]
