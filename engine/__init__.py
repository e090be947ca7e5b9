"""The engine's lower floor: ``core`` (the pure scheduler), ``model`` (the device side) and two leaves the actors
share with the API, ``outputs`` (the frames a stream yields) and ``errors``. Nothing here imports a floor above it;
the public API is the ``tickloom`` package itself (``from tickloom import Engine``)."""
