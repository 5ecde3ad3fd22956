"""The package version, importable without the package root (library modules never import `specdec` itself)."""
__version__ = "0.1.0"
