import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sqjax import baselines, quest, saap, snapkv
from sqjax.kmeans import KMeansConfig, assign, normalize
from sqjax.attention import attend_partial, dense_attention, fixed_context_attention, merge_partials
from sqjax.budget import account
from sqjax.methods import (
    ContextData, Full, HierarchicalSqueezed, Oracle, Quest, Saap, SnapKV, Squeezed, StreamingLLM, method_from_name,
)
from sqjax.selection import topk_mask


def np_softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


# --------------------------------------------------------------------------------- attention

def test_partials_merge_equals_dense(rng):
    hq, hkv, t, s1, s2, d = 6, 2, 5, 40, 23, 8
    q, k1, v1, k2, v2 = (rng.normal(size=sh).astype(np.float32) for sh in
                         [(hq, t, d), (hkv, s1, d), (hkv, s1, d), (hkv, s2, d), (hkv, s2, d)])
    m1 = rng.random((hkv, 1, s1)) < 0.5
    m1[0] = False  # a head with nothing retrieved in set 1: the other set holds the softmax
    m2 = np.ones((1, t, s2), bool)
    parts = [attend_partial(*(jnp.asarray(a) for a in (q, k1, v1, m1)), 0.3),
             attend_partial(*(jnp.asarray(a) for a in (q, k2, v2, m2)), 0.3)]
    got = np.asarray(merge_partials(*parts).o)
    # brute force: concatenate visible keys per head
    g = hq // hkv
    for h in range(hq):
        kk = np.concatenate([k1[h // g][m1[h // g, 0]], k2[h // g]])
        vv = np.concatenate([v1[h // g][m1[h // g, 0]], v2[h // g]])
        p = np_softmax(0.3 * q[h] @ kk.T)
        np.testing.assert_allclose(got[h], p @ vv, rtol=1e-5, atol=1e-6)


def test_nothing_visible_gives_zero_not_nan():
    q = jnp.ones((2, 1, 4))
    k = jnp.ones((1, 3, 4))
    p = attend_partial(q, k, k, jnp.zeros((1, 1, 3), bool), 1.0)
    assert np.all(np.asarray(p.o) == 0) and np.all(np.isneginf(np.asarray(p.lse)))
    m = merge_partials(p, p)
    assert not np.isnan(np.asarray(m.o)).any()


@pytest.mark.parametrize("hm,tm", [(None, None), (1, 1), ("kv", "t"), ("q", "t"), ("q", 1)])
def test_attention_over_key_chunks_equals_all_keys_at_once(rng, hm, tm):
    """The running softmax over key chunks (long fixed contexts) gives what all keys at once give:
    ragged last chunk, a mask per KV head / query head / shared, queries and whole heads that
    see no key of the set, bf16 keys."""
    hq, hkv, t, d = 6, 2, 5, 8
    s = int(rng.integers(700, 1300))                      # chunks of 256 / 512: a ragged last one
    q = jnp.asarray(rng.normal(size=(hq, t, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(hkv, s, d)), jnp.bfloat16) for _ in range(2))
    mask = None
    if hm is not None:
        h = {1: 1, "kv": hkv, "q": hq}[hm]
        m = rng.random((h, t if tm == "t" else 1, s)) < rng.uniform(0.01, 0.3)
        if h > 1:
            m[0] = False                                  # a head sees nothing here
        else:
            m[..., -1] = True                             # the shared mask sees the ragged tail's last key
        if tm == "t":
            m[-1, -1, :] = False                          # one query of the last head sees nothing
            m[-1, 0, -3:] = True                          # and one sees the ragged tail
        mask = jnp.asarray(m)
    want = attend_partial(q, k, v, mask, 0.3, chunk=s)
    for chunk in (256, 512):
        got = attend_partial(q, k, v, mask, 0.3, chunk=chunk)
        np.testing.assert_allclose(np.asarray(got.o), np.asarray(want.o), rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(np.asarray(got.lse), np.asarray(want.lse), rtol=2e-6, atol=2e-6)
        assert np.array_equal(np.isneginf(np.asarray(got.lse)), np.isneginf(np.asarray(want.lse)))
    if mask is not None and hm != 1:
        assert np.isneginf(np.asarray(want.lse)).any() and np.all(np.asarray(want.o)[0] == 0)
    else:
        assert np.isfinite(np.asarray(want.lse)).all()
    with pytest.raises(ValueError, match="chunk must be >= 1; got 0"):
        attend_partial(q, k, v, mask, 0.3, chunk=0)


def test_long_context_block_attention_memory_is_bounded():
    """A 2048-token question block over a 128K fixed context (Llama-3-8B heads, a QUEST-style
    per-token mask) compiles to < 8 GB of temporaries: all keys at once needed ~70 GB."""
    from sqjax.attention import key_chunk

    hq, hkv, t, length, d = 32, 8, 2048, 131072, 128
    assert key_chunk(hq * t, length) == 8192 and key_chunk(hq * 128, length) == length
    assert key_chunk(hq * t, length, score_bytes=1 << 29) == 2048 and key_chunk(10 ** 9, length) == 512
    bf, i32 = jnp.bfloat16, jnp.int32
    args = [jax.ShapeDtypeStruct(sh, dt) for sh, dt in
            [((hq, t, d), bf), ((hkv, length, d), bf), ((hkv, length, d), bf), ((hkv, t, length), jnp.bool_),
             ((hkv, t, d), bf), ((hkv, t, d), bf), ((t,), i32), ((t,), i32)]]
    fn = jax.jit(lambda *a: fixed_context_attention(*a, 0.088))
    temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < 8e9, temp


def test_attention_shape_errors():
    with pytest.raises(ValueError, match=r"q must have shape \[Hq, T, d\]"):
        attend_partial(jnp.zeros((2, 4)), jnp.zeros((1, 3, 4)), jnp.zeros((1, 3, 4)), None, 1.0)
    with pytest.raises(ValueError, match="head dim"):
        attend_partial(jnp.zeros((2, 1, 4)), jnp.zeros((1, 3, 8)), jnp.zeros((1, 3, 8)), None, 1.0)
    with pytest.raises(ValueError, match="mask covers 2 keys but k has 3"):
        attend_partial(jnp.zeros((2, 1, 4)), jnp.zeros((1, 3, 4)), jnp.zeros((1, 3, 4)), jnp.ones((1, 1, 2), bool), 1.0)


# --------------------------------------------------------------------------------- QUEST

def test_quest_bounds_of_bf16_keys_are_exact_without_an_f32_copy(rng):
    """bf16 keys: the bounds equal the f32 min/max of the same values, come out f32, and no
    array of the keys' size is f32 in the program (an f32 copy failed at 32 heads x 512K)."""
    hkv, length, d, page = 3, 70, 16, 16   # ragged last page
    k = jnp.asarray(rng.normal(size=(hkv, length, d)), jnp.bfloat16)
    kmin, kmax = quest.page_bounds(k, page)
    kmin32, kmax32 = quest.page_bounds(k.astype(jnp.float32), page)
    assert kmin.dtype == kmax.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(kmin), np.asarray(kmin32))
    np.testing.assert_array_equal(np.asarray(kmax), np.asarray(kmax32))
    jaxpr = jax.make_jaxpr(lambda x: quest.page_bounds(x, page))(k)
    sizes = [v.aval.size for e in jaxpr.eqns for v in e.outvars if v.aval.dtype == jnp.float32]
    assert sizes and max(sizes) < length * d, sizes


def test_quest_bounds_and_upper_bound(rng):
    hkv, hq, length, d, page = 2, 4, 101, 8, 16  # ragged last page
    k = rng.normal(size=(hkv, length, d)).astype(np.float32)
    q = rng.normal(size=(hq, 3, d)).astype(np.float32)
    kmin, kmax = quest.page_bounds(jnp.asarray(k), page)
    n_pages = -(-length // page)
    assert kmin.shape == (hkv, n_pages, d)
    for p in range(n_pages):
        blk = k[:, p * page:(p + 1) * page]
        np.testing.assert_array_equal(np.asarray(kmin[:, p]), blk.min(1))
        np.testing.assert_array_equal(np.asarray(kmax[:, p]), blk.max(1))
    u = np.asarray(quest.page_scores(jnp.asarray(q), kmin, kmax, vote="q"))  # [Hq, T, P]
    g = hq // hkv
    for h in range(hq):
        for t in range(3):
            dots = k[h // g] @ q[h, t]
            for p in range(n_pages):
                true_max = dots[p * page:(p + 1) * page].max()
                assert u[h, t, p] >= true_max - 1e-5
                want = np.sum(np.maximum(q[h, t] * np.asarray(kmax[h // g, p]), q[h, t] * np.asarray(kmin[h // g, p])))
                np.testing.assert_allclose(u[h, t, p], want, rtol=1e-5, atol=1e-5)
    ukv = np.asarray(quest.page_scores(jnp.asarray(q), kmin, kmax, vote="kv"))
    np.testing.assert_allclose(ukv, u.reshape(hkv, g, 3, -1).max(1), rtol=1e-6)


def test_quest_select_topk_with_forced_page(rng):
    s = rng.normal(size=(3, 2, 20)).astype(np.float32)
    s[..., 19] = -100.0
    m = np.asarray(quest.select_pages(jnp.asarray(s), 5, forced_page=19))
    assert np.all(m.sum(-1) == 5) and np.all(m[..., 19])
    for i in range(3):
        for t in range(2):
            top4 = set(np.argsort(-s[i, t, :19])[:4].tolist())
            assert set(np.nonzero(m[i, t, :19])[0].tolist()) == top4


@pytest.mark.parametrize("length,n_pages", [(300, 5), (297, 5), (297, 40), (16, 1)])
def test_quest_page_rows_are_the_selected_pages_keys(rng, length, n_pages):
    """`page_rows` (what a CPU gathers) holds exactly the keys of `select_pages`' mask: a last page
    cut short by the fixed context's end, more pages asked than exist, one page."""
    p = -(-length // 16)
    s = jnp.asarray(rng.normal(size=(3, p)).astype(np.float32))
    pos = np.asarray(quest.page_rows(s, n_pages, p - 1, length, 16))
    mask = np.asarray(quest.pages_to_keys(quest.select_pages(s, n_pages, forced_page=p - 1), length, 16))
    assert pos.shape == (3, min(n_pages, p) * 16) and pos.dtype == np.int32
    for h in range(3):
        assert sorted(pos[h][pos[h] >= 0].tolist()) == np.nonzero(mask[h])[0].tolist()
    with pytest.raises(ValueError, match=r"scores.*\[Hs, P\]"):
        quest.page_rows(s[None], n_pages, p - 1, length, 16)


# --------------------------------------------------------------------------------- SnapKV

@pytest.mark.parametrize("pool", ["max", "avg"])
def test_snapkv_matches_numpy_and_keeps_exactly_cap(rng, pool):
    hkv, hq, length, d, w, cap = 2, 6, 120, 8, 8, 37
    k = rng.normal(size=(hkv, length, d)).astype(np.float32)
    qw = rng.normal(size=(hq, w, d)).astype(np.float32)
    keep = np.asarray(snapkv.snapkv_keep(jnp.asarray(qw), jnp.asarray(k), cap, 0.35, kernel=7, pool=pool))
    assert np.all(keep.sum(-1) == cap)
    assert np.all(keep[:, -w:])
    # numpy Listing 1
    g = hq // hkv
    votes = np.zeros((hq, length - w))
    for h in range(hq):
        logits = 0.35 * qw[h] @ k[h // g].T
        for i in range(w):
            logits[i, length - w + i + 1:] = -np.inf
        votes[h] = np_softmax(logits)[:, : length - w].sum(0)
    padded = np.pad(votes, ((0, 0), (3, 3)), constant_values=-np.inf if pool == "max" else 0.0)
    win = np.lib.stride_tricks.sliding_window_view(padded, 7, axis=-1)
    pooled = win.max(-1) if pool == "max" else win.sum(-1) / 7
    pooled = pooled.reshape(hkv, g, -1).mean(1)
    for h in range(hkv):
        want = set(np.argsort(-pooled[h], kind="stable")[: cap - w].tolist())
        got = set(np.nonzero(keep[h, : length - w])[0].tolist())
        # ties aside, the same positions
        assert len(got ^ want) == 0 or np.allclose(sorted(pooled[h][list(got)]), sorted(pooled[h][list(want)]))


# --------------------------------------------------------------------------------- SAAP

def test_saap_assign_keys_of_bf16_keys_without_an_f32_copy(rng):
    """Keys normalized chunk by chunk: same labels as normalizing all of them first, and no
    f32 array of the keys' size outside the loop (8 GiB at 32 KV heads x 512K on a GPU)."""
    hkv, n, c, d = 2, 300, 12, 16
    k_pre = jnp.asarray(rng.normal(size=(hkv, n, d)), jnp.bfloat16)
    cent = jnp.asarray(rng.normal(size=(hkv, c, d)).astype(np.float32))
    got = np.asarray(saap.assign_keys(k_pre, cent, chunk=64))
    want = np.stack([np.asarray(assign(normalize(k_pre[h]), normalize(cent[h]), 64)) for h in range(hkv)])
    np.testing.assert_array_equal(got, want)
    jaxpr = jax.make_jaxpr(lambda x: saap.assign_keys(x, cent, chunk=64))(k_pre)
    sizes = [v.aval.size for e in jaxpr.eqns for v in e.outvars if v.aval.dtype == jnp.float32]
    assert sizes and max(sizes) < hkv * n * d, sizes


def test_saap_inverted_lists_partition_keys(rng):
    hkv, n, c, d = 3, 500, 16, 8
    k_pre = jnp.asarray(rng.normal(size=(hkv, n, d)).astype(np.float32))
    cent = jnp.asarray(rng.normal(size=(hkv, c, d)).astype(np.float32))
    labels = np.asarray(saap.assign_keys(k_pre, cent, chunk=64))
    off, lst = (np.asarray(a) for a in saap.inverted_lists(jnp.asarray(labels), c))
    for h in range(hkv):
        assert off[h, 0] == 0 and off[h, -1] == n
        assert sorted(lst[h].tolist()) == list(range(n)), "every key exactly once"
        for b in range(c):
            members = lst[h, off[h, b]:off[h, b + 1]]
            assert np.all(labels[h, members] == b)
        # nearest centroid by cosine, brute force
        kn = np.asarray(k_pre[h]) / np.linalg.norm(np.asarray(k_pre[h]), axis=-1, keepdims=True)
        cn = np.asarray(cent[h]) / np.linalg.norm(np.asarray(cent[h]), axis=-1, keepdims=True)
        np.testing.assert_array_equal(labels[h], np.argmax(kn @ cn.T, -1))


def test_saap_mask_buckets_plus_dense(rng):
    hkv, hq, length, c, d = 2, 4, 300, 10, 8
    labels = rng.integers(0, c, size=(hkv, length)).astype(np.int32)
    q_pre = rng.normal(size=(hq, 3, d)).astype(np.float32)
    cent = rng.normal(size=(hkv, c, d)).astype(np.float32)
    scores = np.asarray(saap.nearest_centroid_scores(jnp.asarray(q_pre), jnp.asarray(cent)))
    visited = np.asarray(saap.visited_buckets(jnp.asarray(scores), 3))
    mask = np.asarray(saap.saap_mask(jnp.asarray(visited), jnp.asarray(labels), saap.dense_part(length, 1, 20)))
    g = hq // hkv
    for h in range(hkv):
        for t in range(3):
            qs = q_pre[h * g:(h + 1) * g, t]
            cn = cent[h] / np.linalg.norm(cent[h], axis=-1, keepdims=True)
            sc = ((qs / np.linalg.norm(qs, axis=-1, keepdims=True)) @ cn.T).sum(0)
            top = np.argsort(-sc)[:3]
            want = np.isin(labels[h], top)
            want[0] = True
            want[-20:] = True
            np.testing.assert_array_equal(mask[h, t], want)


# --------------------------------------------------------------------------------- oracle / streaming

def test_oracle_picks_true_topk(rng):
    hkv, hq, length, d = 2, 4, 200, 8
    k = rng.normal(size=(hkv, length, d)).astype(np.float32)
    q = rng.normal(size=(hq, 2, d)).astype(np.float32)
    m = np.asarray(baselines.oracle_topk_mask(jnp.asarray(q), jnp.asarray(k), 0.5, 30, 10, "kv"))
    assert np.all(m.sum(-1) == 40) and np.all(m[..., -10:])
    g = hq // hkv
    for h in range(hkv):
        for t in range(2):
            p = np.mean([np_softmax(0.5 * k[h] @ q[h * g + j, t]) for j in range(g)], axis=0)[:190]
            assert set(np.nonzero(m[h, t, :190])[0].tolist()) == set(np.argsort(-p)[:30].tolist())


def test_topk_mask_exact_count(rng):
    x = jnp.asarray(rng.normal(size=(3, 4, 50)).astype(np.float32))
    m = np.asarray(topk_mask(x, 7))
    assert np.all(m.sum(-1) == 7)
    assert np.asarray(topk_mask(x, 0)).sum() == 0


def test_streaming_mask():
    m = np.asarray(baselines.streaming_mask(50, 4, 6))
    assert m.sum() == 10 and m[:4].all() and m[-6:].all()


# --------------------------------------------------------------------------------- methods + accounting

def _data(rng, n_layers=3, hkv=2, hq=4, length=700, d=16):
    k = jnp.asarray(rng.normal(size=(n_layers, hkv, length, d)).astype(np.float32))
    v = jnp.asarray(rng.normal(size=(n_layers, hkv, length, d)).astype(np.float32))
    q_obs = jnp.asarray(rng.normal(size=(n_layers, hq, 100, d)).astype(np.float32))
    return ContextData(k, v, q_obs, k_pre=k, scale=1 / math.sqrt(d))


ALL = [
    Full(), Squeezed(sparsity=0.7), Squeezed(sparsity=0.9, vote="q"),
    HierarchicalSqueezed(centroid_fraction=0.1, level1_fraction=0.02), Quest(budget=0.2), SnapKV(budget=0.2),
    StreamingLLM(budget=0.2), Oracle(budget=0.2), Saap(probes=3),
]


@pytest.mark.parametrize("method", ALL, ids=lambda m: m.label)
def test_accounting_equals_rows_read(rng, method):
    data = _data(rng)
    index, _ = method.build(data)
    q = jnp.asarray(rng.normal(size=(4, 5, 16)).astype(np.float32))
    sels = [method.select(index, layer, q, q, data.k[layer]) for layer in range(data.n_layers)]
    rep = account(sels, data.length, 16, 2, bytes_per_elem=2)
    rows_read = []
    for layer, s in enumerate(sels):
        if s.mask is None:
            rows = np.full((method.selection_heads(4, 2),), data.length, float)
        else:
            rows = np.asarray(s.mask).sum(-1).mean(-1)  # the rows attention reads
        if s.retrieval is not None:
            np.testing.assert_array_equal(np.asarray(s.retrieval.count), np.asarray(s.mask).sum(-1)[:, 0])
        rows_read.append(rows)
        np.testing.assert_allclose(rep.rows[layer], rows)
    bytes_kv = 2 * np.sum(rows_read) * 16 * 2
    bytes_meta = np.sum([np.asarray(s.meta_rows).mean(-1).sum() for s in sels]) * 16 * 2
    np.testing.assert_allclose(rep.bytes_moved, bytes_kv + bytes_meta)
    assert 0 < rep.overall <= 1.0 + 1e-9 or method.name == "quest"


def test_squeezed_budget_formula():
    # 90% sparsity with 5% centroids: 0.10 + 0.05/2 on the clustered part (Table 2)
    m = Squeezed(sparsity=0.9, centroid_fraction=0.05, n_obs=100)
    length = 100_100
    assert abs(m.expected_budget(length) - ((0.1 * 100_000 + 100 + 2500) / length)) < 1e-9


@pytest.mark.parametrize("method", [m for m in ALL if m.name != "full"], ids=lambda m: m.label)
def test_all_keys_budget_reproduces_full(rng, method):
    """At budget 1.0 (every key retrieved) each method equals full attention."""
    full_versions = {
        "squeezed": Squeezed(sparsity=0.5, capacity_fraction=1.0, vote=getattr(method, "vote", "kv")),
        "hsqueezed": None, "quest": Quest(budget=1.0), "snapkv": SnapKV(budget=1.0),
        "streaming": StreamingLLM(budget=1.0), "oracle": Oracle(budget=1.0), "saap": Saap(probes=10_000),
    }
    m = full_versions[method.name]
    if m is None:
        return
    data = _data(rng)
    index, _ = m.build(data)
    q = jnp.asarray(rng.normal(size=(4, 5, 16)).astype(np.float32))
    kn = jnp.asarray(rng.normal(size=(2, 5, 16)).astype(np.float32))
    pos = jnp.arange(5) + data.length
    for layer in range(data.n_layers):
        if m.name == "squeezed":
            # threshold below every score: everything retrieved
            ret_all = m.select(index.__class__(index.layers, jnp.float32(-1.0), index.threshold1, index.n_tail, index.capacity), layer, q, q, data.k[layer])
            sel = ret_all
        else:
            sel = m.select(index, layer, q, q, data.k[layer])
        got = fixed_context_attention(q, data.k[layer], data.v[layer], sel.mask, kn, kn, pos, pos, 0.25)
        want = fixed_context_attention(q, data.k[layer], data.v[layer], None, kn, kn, pos, pos, 0.25)
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= 1e-5


def test_method_errors():
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        method_from_name("nope")
    with pytest.raises(ValueError, match="sparsity"):
        Squeezed(sparsity=1.5)
    with pytest.raises(ValueError, match="budget"):
        Quest(budget=0.0)
    with pytest.raises(ValueError, match="probes"):
        Saap(probes=0)
    with pytest.raises(ValueError, match=r"v shape \(1, 1, 5, 4\) must equal k shape \(1, 1, 6, 4\)"):
        ContextData(jnp.zeros((1, 1, 6, 4)), jnp.zeros((1, 1, 5, 4)), jnp.zeros((1, 1, 2, 4)))
    with pytest.raises(ValueError, match=r"k must have shape \[layers, Hkv, L, d\]"):
        ContextData(jnp.zeros((1, 6, 4)), jnp.zeros((1, 6, 4)), jnp.zeros((1, 1, 2, 4)))
    with pytest.raises(ValueError, match="de-roped keys"):
        Saap().build(ContextData(jnp.zeros((1, 1, 6, 4)), jnp.zeros((1, 1, 6, 4)), jnp.zeros((1, 1, 2, 4))))


# --------------------------------------------------------------------------------- input checks

def test_attention_of_an_empty_key_set_is_zero_with_lse_minus_inf(rng):
    q, k, v = (jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in [(4, 2, 8), (2, 5, 8), (2, 5, 8)])
    p = attend_partial(q, k[:, :0], v[:, :0], None, 0.3)
    assert p.o.shape == (4, 2, 8) and np.all(np.asarray(p.o) == 0) and np.all(np.isneginf(np.asarray(p.lse)))
    p = attend_partial(q, k[:, :0], v[:, :0], jnp.ones((1, 2, 0), bool), 0.3)
    assert np.all(np.isneginf(np.asarray(p.lse)))
    # no user-input keys: the fixed part alone
    pos = jnp.arange(2) + 5
    got = fixed_context_attention(q, k, v, None, k[:, :0], v[:, :0], pos, jnp.zeros((0,), jnp.int32), 0.3)
    want = merge_partials(attend_partial(q, k, v, None, 0.3)).o
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_attention_token_and_position_shape_errors():
    q, k = jnp.zeros((4, 2, 8)), jnp.zeros((2, 5, 8))
    with pytest.raises(ValueError, match=r"T in \(1, 2\); got mask \(1, 3, 5\), q \(4, 2, 8\)"):
        attend_partial(q, k, k, jnp.ones((1, 3, 5), bool), 1.0)
    with pytest.raises(ValueError, match=r"H in \(1, Hkv=2, Hq=4\)"):
        attend_partial(q, k, k, jnp.ones((3, 1, 5), bool), 1.0)
    with pytest.raises(ValueError, match="inconsistent query tokens: q=2, q_pos=3"):
        fixed_context_attention(q, k, k, None, k[:, :3], k[:, :3], jnp.arange(3), jnp.arange(3), 1.0)
    with pytest.raises(ValueError, match="inconsistent keys: k_new=3, kv_pos=4"):
        fixed_context_attention(q, k, k, None, k[:, :3], k[:, :3], jnp.arange(2), jnp.arange(4), 1.0)
    with pytest.raises(ValueError, match="inconsistent query tokens: q=2, q_pos=1"):
        dense_attention(q, k, k, jnp.arange(1), jnp.arange(5), 1.0)


def test_quest_input_errors():
    with pytest.raises(ValueError, match="k must be a floating dtype.*got int32"):
        quest.page_bounds(jnp.ones((2, 40, 8), jnp.int32), 16)
    kmin = jnp.zeros((2, 4, 8))
    with pytest.raises(ValueError, match=r"inconsistent page bounds shape: kmin=\(2, 4, 8\), kmax=\(2, 5, 8\)"):
        quest.page_scores(jnp.zeros((4, 1, 8)), kmin, jnp.zeros((2, 5, 8)))
    with pytest.raises(ValueError, match="vote must be one of"):
        quest.page_scores(jnp.zeros((4, 1, 8)), kmin, kmin, "x")
    with pytest.raises(ValueError, match=r"P = ceil\(L / page\) = 7 \(L=100, page=16\); got shape \(2, 3\)"):
        quest.pages_to_keys(jnp.ones((2, 3), bool), 100, 16)
    assert quest.pages_to_keys(jnp.ones((2, 7), bool), 100, 16).shape == (2, 100)


def test_saap_and_snapkv_input_errors():
    with pytest.raises(ValueError, match="inconsistent head dim: k_pre=8, unit_centroids=4"):
        saap.assign_keys(jnp.ones((2, 10, 8)), jnp.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="inconsistent KV heads: k_pre=2, unit_centroids=1"):
        saap.assign_keys(jnp.ones((2, 10, 8)), jnp.ones((1, 3, 8)))
    with pytest.raises(ValueError, match="inconsistent head dim: q_pre=8, unit_centroids=4"):
        saap.nearest_centroid_scores(jnp.ones((2, 1, 8)), jnp.ones((2, 3, 4)))
    for kernel, msg in [(6, "kernel must be odd"), (0, "kernel must be >= 1; got 0"), (7.0, "kernel must be an integer")]:
        with pytest.raises(ValueError, match=msg):
            snapkv.pool1d(jnp.ones((2, 10)), kernel, "max")


def test_baselines_input_errors_and_tail_clamp(rng):
    q = jnp.asarray(rng.normal(size=(4, 2, 8)).astype(np.float32))
    k = jnp.asarray(rng.normal(size=(2, 40, 8)).astype(np.float32))
    with pytest.raises(ValueError, match="vote must be one of .*got 'x'"):
        baselines.true_attention(q, k, 0.5, "x")
    with pytest.raises(ValueError, match=r"q must have shape \[Hq, T, d\]"):
        baselines.true_attention(q[:, 0], k, 0.5, "kv")
    with pytest.raises(ValueError, match="inconsistent head dim: q=8, k=4"):
        baselines.true_attention(q, k[..., :4], 0.5, "kv")
    with pytest.raises(ValueError, match="n_tail must be >= 0; got -1"):
        baselines.oracle_topk_mask(q, k, 0.5, 5, -1, "kv")
    m = np.asarray(baselines.oracle_topk_mask(q, k, 0.5, 5, 100, "kv"))  # a tail past L: the whole context
    assert m.shape == (2, 2, 40) and m.all()
    with pytest.raises(ValueError, match="n_recent must be >= 0"):
        baselines.streaming_mask(50, 4, -1)


def test_method_field_errors():
    cases = [
        (lambda: StreamingLLM(n_sink=-1), "n_sink must be >= 0; got -1"),
        (lambda: Oracle(vote="x"), "vote must be one of .*got 'x'"),
        (lambda: Oracle(n_tail=-1), "n_tail must be >= 0; got -1"),
        (lambda: Quest(page=0), "page must be >= 1; got 0"),
        (lambda: Quest(vote="x"), "vote must be one of"),
        (lambda: SnapKV(kernel=6), "kernel must be odd"),
        (lambda: SnapKV(kernel=0), "kernel must be >= 1; got 0"),
        (lambda: SnapKV(kernel=-1), "kernel must be >= 1; got -1"),
        (lambda: Saap(n_buckets=0), "n_buckets must be >= 1; got 0"),
        (lambda: Saap(n_recent=-1), "n_recent must be >= 0; got -1"),
        (lambda: Saap(n_sink=-1), "n_sink must be >= 0; got -1"),
        (lambda: Saap(probes=2.5), r"probes must be an integer >= 1; got 2.5 \(float\)"),
        (lambda: Squeezed(n_obs=1.5), r"n_obs must be an integer >= 1; got 1.5 \(float\)"),
        (lambda: Squeezed(seed=2 ** 32), r"seed must be an integer in \[0, 2\*\*32\); got 4294967296"),
        (lambda: Saap(seed=-1), r"seed must be an integer in \[0, 2\*\*32\); got -1"),
        (lambda: KMeansConfig(4, seed=1.0), r"seed must be an integer in \[0, 2\*\*32\); got 1.0"),
        (lambda: Squeezed(sparsity="0.9"), r"sparsity must be a number in \(0, 1\); got '0.9' \(str\)"),
        (lambda: Squeezed(kmeans_init="x"), "kmeans_init must be one of"),
        (lambda: Squeezed(n_centroids=2.0), "n_centroids must be an integer >= 1 or None"),
        (lambda: Squeezed(kmeans_iters=-1), "kmeans_iters must be >= 0"),
        (lambda: Quest(budget="0.1"), "budget must be a number"),
        (lambda: Full(dense_layers=-1), "dense_layers must be >= 0; got -1"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError, match=msg):
            make()
    # only None picks the default bucket count
    assert Saap(n_buckets=5).sizes(700) == (5, 63) and Saap().sizes(700) == (16, 63)


def test_saap_with_a_probe_for_every_bucket_warns(rng):
    """Saap() on a short context (16 buckets below 1K tokens, 32 probes) reads everything: it says so
    at build time and names the probe count that reads sparsely; fewer probes build quietly."""
    import warnings

    data = _data(rng, n_layers=1)
    with pytest.warns(UserWarning, match=r"Saap\(probes=32\) visits all 16 buckets of this 700-token context.*"
                                         r"pass probes < 16"):
        Saap().build(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Saap(probes=15).build(data)


def test_streaming_sink_past_the_budget_is_an_error():
    k = jnp.zeros((2, 630, 8))
    q = jnp.zeros((4, 1, 8))
    with pytest.raises(ValueError, match="n_sink .1000. exceeds the budget: budget 0.01 of the 630-token fixed context is 7 tokens"):
        StreamingLLM(budget=0.01, n_sink=1000).select(None, 0, q, None, k)
    with pytest.raises(ValueError, match="n_sink .8. exceeds the budget"):
        StreamingLLM(budget=0.01, n_sink=8).expected_budget(630)
    m = StreamingLLM(budget=0.01, n_sink=7)  # the sink fills the budget exactly
    assert int(m.select(None, 0, q, None, k).kv_rows[0, 0]) == 7 and m.expected_budget(630) == 7 / 630


def test_saap_short_document_names_the_bucket_count(rng):
    data = _data(rng, n_layers=1, length=12)
    with pytest.raises(ValueError, match=r"n_buckets=16 \(the default for this length\) > 12 tokens; use a longer "
                                         "document or a smaller n_buckets"):
        Saap().build(data)
    with pytest.raises(ValueError, match=r"n_buckets=13 > 12 tokens"):
        Saap(n_buckets=13).build(data)
    index, info = Saap(n_buckets=4, n_recent=2).build(data)
    assert info["n_buckets"] == 4


@pytest.mark.parametrize("method, shortest, message", [
    # one key past the exact sink + tail: one cluster
    (Squeezed(n_sink=1), 102, "it attends the first n_sink = 1 and the last n_obs = 100 tokens exactly"),
    # 30 clustered keys: round(0.05 * 30) = 2 level-2 clusters, more than the one level-1 cluster
    (HierarchicalSqueezed(n_sink=1), 131, r"level-1 clusters \(1\) must be fewer than level-2 clusters \(1\)"),
    # 8 clustered keys: round(0.2 * 8) = 2 level-2 clusters over max(1, round(0.05 * 8)) = 1
    (HierarchicalSqueezed(n_obs=20, centroid_fraction=0.2, level1_fraction=0.05), 28, "the last n_obs = 20 tokens"),
    # the 32 window queries vote on the keys before them
    (SnapKV(budget=0.2), 33, "not more than SnapKV's observation window of 32"),
], ids=["squeezed", "hsqueezed", "hsqueezed-small", "snapkv"])
def test_a_context_too_short_for_the_method_names_the_shortest_that_builds(rng, method, shortest, message):
    """`check_length` (run by `FixedContext.build` before the prefill) says how many tokens the
    method needs, and a context of exactly that many builds."""
    with pytest.raises(ValueError, match=f"has {shortest - 1} tokens.*{message}.*it needs at least {shortest} tokens"
                                         ".*longer document"):
        method.check_length(shortest - 1)
    method.check_length(shortest)
    k = jnp.asarray(rng.normal(size=(1, 2, shortest, 16)).astype(np.float32))
    q_obs = jnp.asarray(rng.normal(size=(1, 4, min(100, shortest), 16)).astype(np.float32))
    index, _ = method.build(ContextData(k, k, q_obs, k_pre=k, scale=0.25))
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(index)
               if jnp.issubdtype(x.dtype, jnp.floating))


def test_hierarchical_settings_that_fit_no_longer_context_say_so():
    """A fixed n_centroids below the level-1 count fails for every longer context too: the
    message asks for other settings, not a longer document."""
    m = HierarchicalSqueezed(n_centroids=3, level1_fraction=0.5)
    m.check_length(103)   # 3 clustered keys: 3 level-2 over round(1.5) = 2 level-1 clusters
    want = (r"cannot index a 131-token fixed context \(31 clustered keys\): level-1 clusters \(16\) must be fewer "
            r"than level-2 clusters \(3\); change n_centroids")
    with pytest.raises(ValueError, match=want):
        m.check_length(131)


def test_the_largest_seed_builds(rng):
    """Seeds are uint32: 2**32 - 1 is valid, and the seeds derived from it for each layer group
    and level wrap instead of overflowing."""
    data = _data(rng, n_layers=2, length=300)
    for m in (HierarchicalSqueezed(centroid_fraction=0.1, level1_fraction=0.02, seed=2 ** 32 - 1),
              Saap(probes=3, seed=2 ** 32 - 1)):
        index, _ = m.build(data)
        assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(index)
                   if jnp.issubdtype(x.dtype, jnp.floating))


def test_index_builds_run_at_full_matmul_precision(rng, monkeypatch):
    """Every method's build and the pure build function trace their matmuls at "highest" (JAX
    defaults float32 matmuls to TF32 on GPUs, which made GPU-built indexes worse: sqjax.precision),
    and the caller's setting is restored afterwards."""
    from sqjax import kmeans as km_mod, squeezed as sq_mod

    data = _data(rng, n_layers=1, length=300)
    seen = []

    def spy(name, orig):
        def run(*a, **k):
            seen.append((name, jax.config.jax_default_matmul_precision))
            return orig(*a, **k)
        return run

    monkeypatch.setattr(sq_mod, "cluster_fixed_context", spy("squeezed", sq_mod.cluster_fixed_context))
    monkeypatch.setattr(km_mod, "spherical_kmeans", spy("saap", km_mod.spherical_kmeans))   # SAAP imports it per build
    before = jax.config.jax_default_matmul_precision
    Squeezed(sparsity=0.7).build(data)
    sq_mod.build_squeezed_index(data.k, data.q_obs, Squeezed(sparsity=0.7).config, data.scale)
    Saap(probes=3).build(data)                     # one k-means per layer
    assert [n for n, _ in seen].count("squeezed") == 2 and "saap" in [n for n, _ in seen]
    assert {p for _, p in seen} == {"highest"}
    assert jax.config.jax_default_matmul_precision == before
    for cls in (Squeezed, HierarchicalSqueezed, Quest, SnapKV, Saap):
        assert hasattr(cls.build, "__wrapped__"), cls
