"""``tickloom bench``: one module per benchmark (``tools/commands/bench.py`` dispatches to them)."""
