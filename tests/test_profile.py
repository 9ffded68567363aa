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
