"""Errors raised while locating or loading a model."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model file or directory could not be loaded.

    The message always names the file (or directory) and what is wrong with it.
    """

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
