"""Run metadata every benchmark JSON carries: device, jax version, git commit, time."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import jax


def git_commit(root: Path | None = None) -> str:
    """SQJAX_GIT_COMMIT (set by whoever ships the tree to a machine without .git), else the commit of
    the sqjax checkout this package is in (``-dirty`` with uncommitted changes to tracked files), else
    'uncommitted'. ``root``: the folder holding ``benchmarks/`` (default: this file's). An installed
    package is no checkout: a repository around site-packages (a project's own .venv) is not sqjax's."""
    env = os.environ.get("SQJAX_GIT_COMMIT")
    if env:
        return env
    root = (Path(__file__).resolve().parent.parent if root is None else Path(root)).resolve()

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or Path(top).resolve() != root:
            return "uncommitted"
        sha = git("rev-parse", "--verify", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "uncommitted"
    if len(sha) != 40:
        return "uncommitted"
    return sha + ("-dirty" if dirty else "")


def device_name() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{getattr(dev, 'device_kind', str(dev))}"


# HBM bandwidth on NVIDIA's datasheets (TB/s), matched on the device name, most specific first: the
# "bandwidth floor" of a kernel is its bytes at this rate (no kernel reaches it; a device-to-device
# copy reaches ~82% on an H100 SXM, ~64% on an H200: benchmarks/results/gpu_h100_kernels, gpu_h200_kernels)
HBM_PEAK_TBPS = (("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100-SXM4-80GB", 2.039),
                 ("A100", 1.555))


def hbm_peak_tbps(device: str) -> float | None:
    """The datasheet HBM bandwidth of `device` (a `device_name()` string), None if unknown (CPU)."""
    return next((tbps for name, tbps in HBM_PEAK_TBPS if name in device), None)


def metadata() -> dict:
    return {
        "device": device_name(),
        "n_devices": jax.device_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _timed_calls(fn: Callable, sets: list[tuple], m: int, k: int) -> tuple[float, int]:
    """Seconds for `m` back-to-back calls cycling over `sets` from set `k`, ending in one
    ``block_until_ready``; -> (seconds, the next set index)."""
    t0 = time.perf_counter()
    out = None
    for _ in range(m):
        out = fn(*sets[k % len(sets)])
        k += 1
    jax.block_until_ready(out)
    return time.perf_counter() - t0, k


def time_ms(fn: Callable, sets: list[tuple], *, reps: int = 20, inner: int = 5) -> float:
    """Median over `reps` of the mean time (ms) of `inner` back-to-back calls cycling over input sets.

    Every set is run once first (compilation, warm-up); sets rotate so caches do not flatter.
    """
    for s in sets:
        jax.block_until_ready(fn(*s))
    samples, k = [], 0
    for _ in range(reps):
        sec, k = _timed_calls(fn, sets, inner, k)
        samples.append(sec / inner)
    return statistics.median(samples) * 1e3


def time_ms_steady(fn: Callable, sets: list[tuple], *, n: int = 4, reps: int = 5) -> float:
    """Steady-state time (ms) per call of back-to-back calls cycling over input sets:
    (T(2n) - T(n)) / n, with T(m) the time of m calls ending in one ``block_until_ready``.

    ``time_ms`` charges the first call's host dispatch (before the device has anything to do)
    and the final sync to its ``inner`` calls; the difference cancels those fixed costs, leaving
    what each additional call adds. Median over `reps` after a warm-up call per set."""
    for s in sets:
        jax.block_until_ready(fn(*s))
    samples, k = [], 0
    for _ in range(reps):
        t_n, k = _timed_calls(fn, sets, n, k)
        t_2n, k = _timed_calls(fn, sets, 2 * n, k)
        samples.append((t_2n - t_n) / n)
    return statistics.median(samples) * 1e3


def dispatch_ms(fn: Callable, sets: list[tuple], *, reps: int = 10) -> float:
    """Host time (ms) until a call returns, the device idle and its inputs ready: what the host
    spends issuing the call (argument handling and launching every kernel of the program), not
    waiting for it. Median over `reps` after a warm-up call per set."""
    for s in sets:
        jax.block_until_ready(fn(*s))
    samples = []
    for i in range(reps):
        t0 = time.perf_counter()
        out = fn(*sets[i % len(sets)])
        samples.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return statistics.median(samples) * 1e3


def time_ms_looped(fn: Callable, queries: list, *, fixed: tuple = (), n_iter: int = 30, reps: int = 7,
                   fold: str = "sum") -> float:
    """Device time (ms) per call: `n_iter` calls ``fn(q, *fixed)`` inside ONE jitted ``fori_loop``.

    Each iteration takes the next query of `queries` (cycled) and folds fn's first output into a
    carried value, so no call is dead code or loop-invariant. The host dispatches one program per
    `n_iter` calls, as a model's decode step dispatches one program for all its layers: what
    remains is the GPU's time, kernel launch gaps included. Pass every big array in `fixed` (they
    become arguments of the program): arrays `fn` closes over would be captured as constants at
    lowering (gigabytes, slow to compile). Median over `reps` after a warm-up call.

    fold: ``"sum"`` adds the sum of the output to a carried scalar; ``"add"`` adds the output
    itself to a carried array of its shape, which keeps the output's sharding: for an output
    sharded over devices (a head-parallel attention) ``"sum"`` would all-reduce every call.
    """
    loop = looped_program(fn, len(queries), n_iter=n_iter, fold=fold)
    return _median_ms_per_call(loop, (jax.numpy.stack(list(queries)), fixed), n_iter, reps)


def looped_program(fn: Callable, n: int, *, n_iter: int, fold: str = "sum") -> Callable:
    """The jitted ``loop(qs [n, ...], fixed)`` that `time_ms_looped` times."""
    if fold not in ("sum", "add"):
        raise ValueError(f"fold must be 'sum' or 'add', got {fold!r}")
    f32 = jax.numpy.float32

    @jax.jit
    def loop(qs, fixed):
        def out(i):
            return jax.tree.leaves(fn(qs[i % n], *fixed))[0].astype(f32)

        if fold == "sum":
            return jax.lax.fori_loop(0, n_iter, lambda i, acc: acc + jax.numpy.sum(out(i)), jax.numpy.zeros((), f32))
        init = jax.numpy.zeros(jax.eval_shape(out, 0).shape, f32)
        return jax.lax.fori_loop(0, n_iter, lambda i, acc: acc + out(i), init)

    return loop


def _median_ms_per_call(prog: Callable, args: tuple, n_calls: int, reps: int) -> float:
    """Median over `reps` (after a warm-up run) of one run of `prog(*args)` / n_calls, in ms."""
    jax.block_until_ready(prog(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(prog(*args))
        samples.append((time.perf_counter() - t0) / n_calls)
    return statistics.median(samples) * 1e3


def time_ms_unrolled(fn: Callable, queries: list, *, fixed: tuple = (), n_calls: int = 8, reps: int = 7,
                     fold: str = "sum") -> float:
    """Device time (ms) per call: `n_calls` calls ``fn(q, *fixed)`` unrolled in ONE jitted program.

    As a model step runs its layers (`models.forward` loops over them in Python): a straight-line
    program that XLA can capture whole in one command buffer (a CUDA graph), with no loop between
    calls. Call i takes query i (cycled) plus a vanishing multiple of what the calls before it
    returned, so calls run in order and no two are the same computation. fold: ``"sum"`` carries
    the scalar sum of fn's first output; ``"add"`` carries the output itself, added elementwise
    into the next query (it must have the query's size), so a head-sharded output feeds a
    head-sharded query with no collective (as `time_ms_looped`'s ``"add"``). Big arrays belong in
    `fixed`. Median over `reps` after a warm-up call. The program's dispatch and final sync are paid
    once per `n_calls` calls: with 16 calls of 0.1-0.2 ms they added 20 (1 GPU) to 31 (2 GPUs) us per
    call over a 300-call `time_ms_looped`, which amortises them (H200s, gpu_sharded_heads/final_9a8d715).
    A difference T(2n) - T(n) of two such programs was tried and was noise-dominated: below the kernel
    busy time for 3 of the 12 paths timed (gpu_h200_decode_stages/loop300_6e7eea1).
    """
    if fold not in ("sum", "add"):
        raise ValueError(f"fold must be 'sum' or 'add', got {fold!r}")
    qs = list(queries)
    f32 = jax.numpy.float32

    @jax.jit
    def prog(qs, fixed):
        acc = jax.numpy.zeros((), f32)
        for i in range(n_calls):
            q = qs[i % len(qs)]
            if fold == "sum" or i == 0:
                q = q + (acc * 1e-30).astype(q.dtype)
            else:
                q = q + (acc.reshape(q.shape) * 1e-30).astype(q.dtype)
            out = jax.tree.leaves(fn(q, *fixed))[0].astype(f32)
            if fold == "add" and out.size != q.size:
                raise ValueError(f"fold='add' feeds the output {out.shape} back into the query {q.shape}: "
                                 "they need the same size")
            acc = acc + (jax.numpy.sum(out) if fold == "sum" else out)
        return acc

    return _median_ms_per_call(prog, (qs, fixed), n_calls, reps)


def write_json(path: Path, payload: dict) -> None:
    from sqjax.index_io import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(payload, default=float))


def report(payload: dict, markdown: str, out: str | None) -> None:
    """Print a run's markdown table; with `out`, write the JSON there and the markdown beside it (.md)."""
    from sqjax.index_io import write_text_atomic

    print(markdown)
    if out:
        write_json(Path(out), payload)
        write_text_atomic(Path(out).with_suffix(".md"), markdown)
