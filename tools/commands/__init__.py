"""The ``tickloom`` subcommands, one module each (``tools/cli.py`` finds them here); ``_``-modules are their helpers."""
