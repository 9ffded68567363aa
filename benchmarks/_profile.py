"""Where the device time goes: a `jax.profiler` trace read back with `jax.profiler.ProfileData`.

`device_activity(run)` traces `run()` and returns, per device plane (``/device:GPU:0`` …), the
time the device was busy (union of kernel intervals over its streams), the span from the first
kernel's start to the last one's end, and the kernels grouped by name and by the HLO op they
belong to (when the trace carries an ``hlo_op`` stat), largest total first. No tensorboard or
xprof needed: the xplane protobuf is parsed by jaxlib itself.

`summarize(events)` is the pure part (tested on CPU with synthetic events): events are
``(line, name, start_ns, end_ns, hlo_op | None)``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable

# lines of a device plane that are derived summaries, not kernels on a stream
_DERIVED = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source code", "XLA TraceMe", "Framework")


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """Total length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _gaps(events: list, top: int) -> list[dict]:
    """The longest idle intervals between kernels, each with the kernel that ended last before it
    and the one that starts it (kernels that overlap count as one busy interval)."""
    gaps, cur_e, cur_name = [], None, None
    for _, name, s, e, _ in sorted(events, key=lambda x: x[2]):
        if cur_e is not None and s > cur_e:
            gaps.append({"ms": (s - cur_e) / 1e6, "after": cur_name, "before": name})
        if cur_e is None or e > cur_e:
            cur_e, cur_name = e, name
    gaps.sort(key=lambda g: -g["ms"])
    return gaps[:top]


def _top(groups: dict, top: int) -> list[dict]:
    rows = [{"name": k, "count": len(v), "total_ms": sum(v) / 1e6} for k, v in groups.items()]
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:top]


def summarize(events: Iterable[tuple[str, str, int, int, str | None]], *, top: int = 20) -> dict:
    """Busy time, span and the largest kernels of one device's events (see the module docstring)."""
    events = list(events)
    if not events:
        return {"n_kernels": 0, "busy_ms": 0.0, "span_ms": 0.0, "by_name": [], "by_hlo_op": [], "gaps": []}
    by_name, by_op = defaultdict(list), defaultdict(list)
    for _, name, s, e, op in events:
        by_name[name].append(e - s)
        if op:
            by_op[op].append(e - s)
    start = min(e[2] for e in events)
    end = max(e[3] for e in events)
    return {"n_kernels": len(events), "busy_ms": _union_ns([(e[2], e[3]) for e in events]) / 1e6,
            "span_ms": (end - start) / 1e6, "streams": sorted({e[0] for e in events}),
            "by_name": _top(by_name, top), "by_hlo_op": _top(by_op, top), "gaps": _gaps(events, top)}


def _stat(event, key: str):
    try:
        with warnings.catch_warnings():  # jaxlib's stats type warns about its __module__
            warnings.simplefilter("ignore", DeprecationWarning)
            for k, v in event.stats:
                if k == key:
                    return str(v)
    except Exception:  # noqa: BLE001 - stats are best effort
        return None
    return None


@contextlib.contextmanager
def _traced(run: Callable[[], object]):
    """Trace ``run()`` and yield the trace read back (`jax.profiler.ProfileData`), or None when no
    trace was written; the trace's files are removed afterwards."""
    import jax
    from jax.profiler import ProfileData

    tmp = tempfile.mkdtemp(prefix="sqjax_trace_")
    try:
        with jax.profiler.trace(tmp):
            run()
        paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        yield ProfileData.from_file(paths[0]) if paths else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _device_planes(data, top: int, plane_prefix: str) -> dict:
    """{plane name: `summarize` dict} for the planes under ``plane_prefix`` that hold kernels."""
    out = {}
    for plane in data.planes:
        if not plane.name.startswith(plane_prefix):
            continue
        events = [(line.name, ev.name, int(ev.start_ns), int(ev.end_ns), _stat(ev, "hlo_op"))
                  for line in plane.lines if line.name not in _DERIVED
                  for ev in line.events if ev.end_ns > ev.start_ns]
        if events:
            out[plane.name] = summarize(events, top=top)
    return out


def _host_lines(data, top: int) -> dict:
    """{"host plane | line": {n_events, span_ms, by_name}}: what each host thread spent its time on."""
    out = {}
    for plane in data.planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            events = [(ev.name, int(ev.start_ns), int(ev.end_ns)) for ev in line.events]
            if not events:
                continue
            groups = defaultdict(list)
            for name, s, e in events:
                groups[name[:120]].append(e - s)
            out[f"{plane.name} | {line.name}"] = {
                "n_events": len(events), "span_ms": (max(e for _, _, e in events) - min(s for _, s, _ in events)) / 1e6,
                "by_name": _top(groups, top)}
    return out


def device_activity(run: Callable[[], object], *, top: int = 20, plane_prefix: str = "/device:") -> dict:
    """Trace ``run()`` and summarize each device plane: {plane name: `summarize` dict}.

    ``run`` must block until its work is done (``jax.block_until_ready``). Planes that hold no
    kernel events (e.g. on CPU, where XLA runs on host threads) are omitted.
    """
    with _traced(run) as data:
        return {} if data is None else _device_planes(data, top, plane_prefix)


def host_and_device_activity(run: Callable[[], object], *, top: int = 20) -> dict:
    """`device_activity` and, per host thread, its events by name: {"device": {...}, "host": {...}}."""
    with _traced(run) as data:
        if data is None:
            return {"device": {}, "host": {}}
        return {"device": _device_planes(data, top, "/device:"), "host": _host_lines(data, top)}


def activity_lines(activity: dict, head: str, *, gaps: int = 4, kernels: int = 0, hosts: int = 4) -> list[str]:
    """Log lines for a `host_and_device_activity` result, each starting with ``head``: the first device's
    busy time, span, kernel count and longest ``gaps``; its ``kernels`` largest kernels (none: 0); the
    ``hosts`` host threads with the longest span and their largest events."""
    dev = next(iter(activity["device"].values()), {})
    lines = [f"{head}: device busy {dev.get('busy_ms', 0):.2f} ms, span {dev.get('span_ms', 0):.2f} ms, "
             f"{dev.get('n_kernels', 0)} kernels; gaps "
             + ", ".join(f"{g['ms']:.2f} ms before {g['before'][:50]}" for g in dev.get("gaps", [])[:gaps])]
    if kernels:
        lines.append(f"{head}: largest kernels " + "; ".join(
            f"{k['name'][:60]} {k['total_ms']:.3f} ms x{k['count']}" for k in dev.get("by_name", [])[:kernels]))
    for line, h in sorted(activity["host"].items(), key=lambda kv: -kv[1]["span_ms"])[:hosts]:
        lines.append(f"{head}:   host {line}: {h['n_events']} events, span {h['span_ms']:.2f} ms; "
                     + "; ".join(f"{x['name'][:50]} {x['total_ms']:.2f} ms x{x['count']}" for x in h["by_name"][:10]))
    return lines


def trace_calls(call: Callable, sets: list, *, n: int, top: int = 12) -> dict:
    """Kernel time per call on every device, from a trace of n back-to-back ``call(*sets[i])``:
    {plane: {busy_ms_per_call, span_ms_per_call (first kernel's start to last kernel's end / n),
    kernels_per_call,
    kernels: [{name, ms_per_call, per_call}], gaps: the longest idle intervals of the trace}}
    ({} without a device)."""
    import jax

    def run():
        out = None
        for i in range(n):
            out = call(*sets[i % len(sets)])
        jax.block_until_ready(out)

    planes = device_activity(run, top=top)
    return {plane: {"busy_ms_per_call": act["busy_ms"] / n, "span_ms_per_call": act["span_ms"] / n,
                    "kernels_per_call": act["n_kernels"] / n, "gaps": act["gaps"],
                    "kernels": [{"name": k["name"], "ms_per_call": k["total_ms"] / n, "per_call": k["count"] / n}
                                for k in act["by_name"]]}
            for plane, act in planes.items()}


def kernel_time_per_call(call: Callable, sets: list, *, n: int = 10, top: int = 12) -> dict | None:
    """`trace_calls` on the first device: {busy_ms_per_call, kernels}, or None without a device."""
    return next(iter(trace_calls(call, sets, n=n, top=top).values()), None)


def loop_trace(fn: Callable, queries: list, *, fixed: tuple = (), n_iter: int, top: int = 6) -> dict | None:
    """A trace of the device loop that ``_meta.time_ms_looped`` times (``n_iter`` calls of ``fn(q, *fixed)`` in one
    jitted ``fori_loop``), per call on the first device: {busy_ms_per_call, span_ms_per_call, kernels_per_call,
    gaps: the longest idle intervals, largest: the kernels (and copies) with the most time}; None without a device.
    What the loop spends beyond the kernels of back-to-back calls shows here (copies, gaps between iterations)."""
    import jax

    from benchmarks._meta import looped_program

    prog = looped_program(fn, len(queries), n_iter=n_iter)
    qs = jax.numpy.stack(list(queries))
    jax.block_until_ready(prog(qs, fixed))
    act = next(iter(device_activity(lambda: jax.block_until_ready(prog(qs, fixed)), top=top).values()), None)
    if act is None:
        return None
    return {"busy_ms_per_call": act["busy_ms"] / n_iter, "span_ms_per_call": act["span_ms"] / n_iter,
            "kernels_per_call": act["n_kernels"] / n_iter, "gaps": act["gaps"][:top],
            "largest": [{"name": k["name"], "ms_per_call": k["total_ms"] / n_iter, "per_call": k["count"] / n_iter}
                        for k in act["by_name"]]}
