"""The `mesh demo` supervisor (demo/supervisor.py)."""
