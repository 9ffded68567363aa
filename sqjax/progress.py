"""Opt-in progress bars for long offline work (prefill, clustering, calibration).

    with progress.enabled(True):
        FixedContext.build(...)   # shows tqdm bars

Off by default so library calls stay quiet; the CLI turns it on unless --json is given.
"""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def is_enabled() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def enabled(on: bool = True):
    prev = is_enabled()
    _state.on = on
    try:
        yield
    finally:
        _state.on = prev


def track(iterable, desc: str, total: int | None = None):
    """`iterable`, wrapped in a tqdm bar when progress is enabled."""
    if not is_enabled():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False)
