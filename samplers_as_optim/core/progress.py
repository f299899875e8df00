"""Progress bars for long calls: ``progress=`` of ``Laplace.fit``, ``HMC.warmup``, ...

``progress=None`` (every such call's default) shows a tqdm bar when standard error is a
terminal and tqdm is installed, and nothing otherwise (a log file, CI, a notebook's
captured output); ``True`` asks for one (an error naming ``progress`` when tqdm is
missing); ``False`` never shows one. tqdm is not a dependency of the library: it comes
with the ``examples`` extra, as laplace-torch's ``fit`` uses it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["ProgressBar", "check_progress", "progress_bar"]

T = TypeVar("T")


def _tqdm_installed() -> bool:
    return importlib.util.find_spec("tqdm") is not None


def check_progress(value: Any) -> bool:
    """``progress=``: None (a bar where stderr is a terminal), True or False -> on or off.

    Raises:
        TypeError: ``value`` is not None, True or False.
        ImportError: ``value`` is True and tqdm is not installed.
    """
    if value is None:
        stream = sys.stderr
        return bool(stream is not None and stream.isatty()) and _tqdm_installed()
    if not isinstance(value, bool):
        raise TypeError(f"Invalid progress: {value!r} (expected None, True or False)")
    if value and not _tqdm_installed():
        raise ImportError(
            "Invalid progress: True needs tqdm, which is not installed (pip install tqdm, "
            "or pass progress=None or False)"
        )
    return value


class ProgressBar:
    """A bar that does nothing when off: ``update``, ``set_postfix``, ``close``."""

    def __init__(self, on: bool, total: int | None, description: str) -> None:
        self._bar: Any = None
        if on:
            tqdm = importlib.import_module("tqdm.auto").tqdm
            self._bar = tqdm(total=total, desc=description, leave=False, dynamic_ncols=True)

    def update(self, count: int = 1) -> None:
        """Advance the bar by ``count`` steps."""
        if self._bar is not None:
            self._bar.update(count)

    def set_postfix(self, **values: Any) -> None:
        """Show ``values`` after the bar (a loss, an acceptance rate)."""
        if self._bar is not None:
            self._bar.set_postfix(values, refresh=False)

    def close(self) -> None:
        """Remove the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(
    items: Iterable[T], progress: Any, description: str, total: int | None = None
) -> Iterator[T]:
    """Iterate over ``items``, with a bar when ``progress`` (checked here) asks for one."""
    on = check_progress(progress)
    return _iterate(items, on, description, total)


def _iterate(items: Iterable[T], on: bool, description: str, total: int | None) -> Iterator[T]:
    if total is None and hasattr(items, "__len__"):
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with ProgressBar(on, total, description) as bar:
        for item in items:
            yield item
            bar.update()
