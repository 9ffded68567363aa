"""benchmarks/_profile.py: device busy time and kernel totals from a profiler trace."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks._profile import _union_ns, device_activity, summarize


def test_union_of_overlapping_and_disjoint_intervals():
    assert _union_ns([]) == 0
    assert _union_ns([(0, 10), (5, 15), (20, 30), (30, 31), (2, 3)]) == 15 + 10 + 1


def test_summarize_groups_kernels_and_counts_overlap_once():
    ev = [("Stream #1", "gemm", 0, 100, "dot.1"), ("Stream #2", "gemm", 50, 150, "dot.1"),
          ("Stream #1", "softmax", 200, 210, None), ("Stream #1", "gemm", 300, 400, "dot.2")]
    s = summarize(ev)
    assert s["n_kernels"] == 4
    assert s["busy_ms"] == pytest.approx((150 + 10 + 100) / 1e6)
    assert s["span_ms"] == pytest.approx(400 / 1e6)
    assert s["streams"] == ["Stream #1", "Stream #2"]
    assert s["by_name"][0] == {"name": "gemm", "count": 3, "total_ms": pytest.approx(300 / 1e6)}
    assert [r["name"] for r in s["by_hlo_op"]] == ["dot.1", "dot.2"]
    assert summarize([])["n_kernels"] == 0
    # idle time between kernels, longest first, named by its neighbours
    assert s["gaps"] == [{"ms": pytest.approx(90 / 1e6), "after": "softmax", "before": "gemm"},
                         {"ms": pytest.approx(50 / 1e6), "after": "gemm", "before": "softmax"}]


def test_device_activity_reads_a_real_trace():
    """On CPU the XLA work runs on host threads: read that plane to check the trace plumbing."""
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    planes = device_activity(lambda: [f(x).block_until_ready() for _ in range(3)], plane_prefix="/host:CPU")
    assert planes, "no events in the host plane"
    act = next(iter(planes.values()))
    assert act["n_kernels"] > 0 and 0 < act["busy_ms"] <= act["span_ms"]
    assert device_activity(lambda: f(x).block_until_ready()) == {}  # no device plane on CPU


def test_activity_lines_name_the_device_the_kernels_and_the_longest_host_threads():
    """`activity_lines`: the device's busy time, span and gaps; the largest kernels only when asked;
    the host threads longest first, as many as asked."""
    from benchmarks._profile import activity_lines, summarize

    dev = summarize([("s", "k1", 0, 3_000_000, None), ("s", "k2", 5_000_000, 6_000_000, None)])
    host = {f"/host:CPU | t{i}": {"n_events": 1, "span_ms": float(i), "by_name": [{"name": f"e{i}", "count": 1,
                                                                                  "total_ms": float(i)}]}
            for i in range(3)}
    lines = activity_lines({"device": {"/device:GPU:0": dev}, "host": host}, "head", kernels=1, hosts=2)
    assert lines[0] == "head: device busy 4.00 ms, span 6.00 ms, 2 kernels; gaps 2.00 ms before k2"
    assert lines[1] == "head: largest kernels k1 3.000 ms x1"
    assert len(lines) == 4 and lines[2].startswith("head:   host /host:CPU | t2: 1 events, span 2.00 ms; e2")
    assert lines[3].startswith("head:   host /host:CPU | t1:")
    assert len(activity_lines({"device": {}, "host": {}}, "x")) == 1
