"""train_qclassifier classifier: inference contract, export/load validation, training step, exact resume."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train_qclassifier.classifier import (
    ClassifierFormatError, QueryClassifier, bucket_distribution, export_classifier, load_classifier,
    params_from_states, stacked_classifiers,
)
from train_qclassifier.config import TrainConfig
from train_qclassifier.data import TrainingSet
from train_qclassifier.train import CheckpointMismatchError, Trainer

L, HKV, G, D, C, HID = 2, 2, 3, 8, 6, 16


def _random_params(rng, layers=L, hkv=HKV, d=D, c=C, hidden=HID):
    """A stacked classifier with non-trivial BatchNorm statistics, as the export pytree [layers, Hkv, ...]."""
    model = stacked_classifiers(layers * hkv, d, hidden, c, seed=int(rng.integers(1 << 30)))
    _, p, s = nnx.split(model, nnx.Param, nnx.BatchStat)
    flat = params_from_states(p, s)
    flat["bn"]["mean"] = jnp.asarray(rng.standard_normal(flat["bn"]["mean"].shape), jnp.float32)
    flat["bn"]["var"] = jnp.asarray(rng.random(flat["bn"]["var"].shape) + 0.5, jnp.float32)
    flat["bn"]["scale"] = jnp.asarray(1 + 0.3 * rng.standard_normal(flat["bn"]["scale"].shape), jnp.float32)
    flat["bn"]["bias"] = jnp.asarray(0.3 * rng.standard_normal(flat["bn"]["bias"].shape), jnp.float32)
    return jax.tree.map(lambda a: a.reshape((layers, hkv) + a.shape[1:]), flat)


def _unit(rng, layers=L, hkv=HKV, c=C, d=D):
    u = rng.standard_normal((layers, hkv, c, d)).astype(np.float32)
    return u / np.linalg.norm(u, axis=-1, keepdims=True)


def test_bucket_distribution_matches_per_head_nnx_loop(rng):
    params = _random_params(rng)
    T = 5
    q_pre = jnp.asarray(rng.standard_normal((HKV * G, T, D)) * 3, jnp.float32)
    for layer in range(L):
        p_l = jax.tree.map(lambda a: a[layer], params)
        got = np.asarray(bucket_distribution(p_l, q_pre))
        assert got.shape == (HKV, T, C)
        want = np.zeros((HKV, T, C))
        m = QueryClassifier(D, HID, C, rngs=nnx.Rngs(0))
        m.eval()  # BatchNorm in inference mode (running statistics)
        graphdef, _ = nnx.split(m)
        head_probs = jax.jit(lambda state, x: jax.nn.softmax(nnx.merge(graphdef, state)(x), axis=-1))
        for h in range(HKV * G):  # the NNX module itself, one query head at a time
            kv = h // G
            m.linear1.kernel[...] = p_l["linear1"]["kernel"][kv]
            m.linear1.bias[...] = p_l["linear1"]["bias"][kv]
            m.linear2.kernel[...] = p_l["linear2"]["kernel"][kv]
            m.linear2.bias[...] = p_l["linear2"]["bias"][kv]
            for name in ("scale", "bias", "mean", "var"):
                getattr(m.bn, name)[...] = p_l["bn"][name][kv]
            want[kv] += np.asarray(head_probs(nnx.split(m)[1], q_pre[h]))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.sum(-1), G, rtol=1e-5)
    # jittable under an outer jit with the per-layer slicing Saap does
    f = jax.jit(lambda p, q: bucket_distribution(jax.tree.map(lambda a: a[1], p), q))
    np.testing.assert_allclose(np.asarray(f(params, q_pre)),
                               np.asarray(bucket_distribution(jax.tree.map(lambda a: a[1], params), q_pre)), rtol=1e-6)
    with pytest.raises(ValueError, match="multiple"):
        bucket_distribution(jax.tree.map(lambda a: a[0], params), q_pre[:5])


def test_export_roundtrip_and_atomic_replace(tmp_path, rng):
    params, unit = _random_params(rng), _unit(rng)
    path = export_classifier(tmp_path / "classifier", unit, params, num_heads=HKV * G, model_info={"name": "toy"})
    clf = load_classifier(path, num_layers=L, num_heads=HKV * G, num_kv_heads=HKV, head_dim=D)
    np.testing.assert_array_equal(np.asarray(clf.unit_centroids), unit)
    for a, b in zip(jax.tree.leaves(clf.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(leaf.shape[:2] == (L, HKV) for leaf in jax.tree.leaves(clf.params))
    assert clf.n_buckets == C and clf.config["model"]["name"] == "toy"
    # a run directory holding classifier/ is accepted too
    assert load_classifier(tmp_path).n_buckets == C
    # re-export replaces atomically; no temp dirs left behind
    export_classifier(path, _unit(rng), params, num_heads=HKV * G)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["classifier"]


def test_load_classifier_rejects_corrupted_or_mismatched_exports(tmp_path, rng):
    from safetensors.numpy import load_file, save_file

    from train_qclassifier.classifier import _sha256

    params, unit = _random_params(rng), _unit(rng)

    def fresh(name):
        return export_classifier(tmp_path / name, unit, params, num_heads=HKV * G)

    with pytest.raises(ClassifierFormatError, match="does not exist"):
        load_classifier(tmp_path / "nope")
    p = fresh("missing")
    (p / "classifier.safetensors").unlink()
    with pytest.raises(ClassifierFormatError, match="missing classifier.safetensors"):
        load_classifier(p)
    p = fresh("flipped")  # a flipped byte in the tensor data
    raw = bytearray((p / "classifier.safetensors").read_bytes())
    raw[-5] ^= 0xFF
    (p / "classifier.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ClassifierFormatError, match="corrupted"):
        load_classifier(p)
    p = fresh("truncated")
    raw = (p / "classifier.safetensors").read_bytes()
    (p / "classifier.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ClassifierFormatError, match="corrupted"):
        load_classifier(p)
    p = fresh("badjson")
    (p / "config.json").write_text("{not json")
    with pytest.raises(ClassifierFormatError, match="not valid JSON"):
        load_classifier(p)
    p = fresh("wrong_c")  # config claims another C: every affected tensor is named
    cfg = json.loads((p / "config.json").read_text())
    cfg["n_buckets"] = C + 1
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ClassifierFormatError, match=r"unit_centroids has shape .*C=7") as e:
        load_classifier(p)
    assert "linear2.kernel" in str(e.value) and "linear2.bias" in str(e.value)
    p = fresh("wrong_shape")  # consistent checksum, but a tensor of the wrong shape
    t = load_file(str(p / "classifier.safetensors"))
    t["linear1.kernel"] = t["linear1.kernel"][:, :1].copy()
    save_file(t, str(p / "classifier.safetensors"))
    cfg = json.loads((p / "config.json").read_text())
    cfg["sha256"] = _sha256(p / "classifier.safetensors")
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ClassifierFormatError, match=r"linear1.kernel has shape \(2, 1, 8, 16\), expected \(2, 2, 8, 16\)"):
        load_classifier(p)
    p = fresh("extra")
    t = load_file(str(p / "classifier.safetensors"))
    del t["bn.var"]
    t["surprise"] = np.zeros(3, np.float32)
    save_file(t, str(p / "classifier.safetensors"))
    cfg = json.loads((p / "config.json").read_text())
    cfg["sha256"] = _sha256(p / "classifier.safetensors")
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ClassifierFormatError, match=r"missing tensors \['bn.var'\], unexpected tensors \['surprise'\]"):
        load_classifier(p)
    p = fresh("model_mismatch")  # valid export, other model
    with pytest.raises(ClassifierFormatError, match="num_layers: classifier has 2, expected 30.*head_dim: classifier has 8, expected 64"):
        load_classifier(p, num_layers=30, head_dim=64)


def test_saap_method_uses_the_export(tmp_path, rng):
    """`sqjax.methods.Saap(classifier=PATH)` builds an index from the export and selects with it."""
    from sqjax.methods import ContextData, Saap

    Ln = 64
    params, unit = _random_params(rng), _unit(rng)
    path = export_classifier(tmp_path / "clf", unit, params, num_heads=HKV * G)
    k = jnp.asarray(rng.standard_normal((L, HKV, Ln, D)), jnp.float32)
    data = ContextData(k=k, v=k, q_obs=jnp.zeros((L, HKV * G, 4, D)), k_pre=k)
    method = Saap(classifier=str(path), probes=2, n_recent=4)
    index, info = method.build(data)
    assert info["n_buckets"] == C
    q = jnp.asarray(rng.standard_normal((HKV * G, 3, D)), jnp.float32)
    sel = method.select(index, 1, q, q, k[1])
    assert sel is not None


def _toy_data(rng, docs=3, layers=2, hkv=2, R=40, d=D, c=C):
    w = rng.standard_normal((layers, hkv, d, c))
    xs, ts, nvs = [], [], []
    for _ in range(docs):
        x = rng.standard_normal((layers, hkv, R, d)).astype(np.float32)
        logits = np.einsum("lkrd,lkdc->lkrc", x, w) * 2
        t = np.exp(logits - logits.max(-1, keepdims=True))
        t = (t / t.sum(-1, keepdims=True)).astype(np.float32)
        xs.append(x), ts.append(t)
        nv = np.full((layers, hkv), R, np.int32)
        nv[0, 1] = 0 if len(nvs) == 1 else R  # a head without long-range queries in one document
        nvs.append(nv)
    return xs, ts, nvs


def test_one_training_step_lowers_the_loss_on_a_fixed_batch(rng):
    xs, ts, nvs = _toy_data(rng)
    data = TrainingSet.from_arrays(xs, ts, nvs, batch_queries=32, seed=0)
    cfg = TrainConfig(hidden=HID, steps=1, lr=1e-2, batch_queries=32, n_buckets=C)
    tr = Trainer(cfg, n_heads=data.n_heads, head_dim=D, n_buckets=C)
    state = tr.init_state()
    b = data.batch(0)
    args = (jnp.asarray(b["x"]), jnp.asarray(b["t"]), jnp.asarray(b["head_valid"]))
    before = float(tr.loss_fn(state, *args))
    state = tr.step_fn(state, *args)
    after = float(tr.loss_fn(state, *args))
    assert float(state["last_loss"]) == pytest.approx(before, rel=1e-5)  # reported loss = pre-update loss
    assert after < before
    assert int(state["step"]) == 1


def test_resume_is_exact(tmp_path, rng):
    xs, ts, nvs = _toy_data(rng)
    cfg = TrainConfig(hidden=HID, steps=7, lr=3e-3, schedule="cosine", warmup=2, batch_queries=16, n_buckets=C,
                      ckpt_every=2)

    def trainer():
        return Trainer(cfg, n_heads=4, head_dim=D, n_buckets=C)

    def data():
        return TrainingSet.from_arrays(xs, ts, nvs, batch_queries=16, seed=5)

    full_state, full_hist = trainer().fit(data(), tmp_path / "a", progress=False)

    def interrupt(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        trainer().fit(data(), tmp_path / "b", progress=False, callback=interrupt)
    assert 3 in [int(p.name) for p in (tmp_path / "b").iterdir() if p.name.isdigit()]
    with pytest.raises(CheckpointMismatchError, match="--resume"):
        trainer().fit(data(), tmp_path / "b", progress=False)
    seen = []
    res_state, res_hist = trainer().fit(data(), tmp_path / "b", progress=False, resume=True,
                                        callback=lambda s, _: seen.append(s))
    assert seen == [4, 5, 6, 7]  # resumed at the same step
    assert len(res_hist["loss"]) == 7
    np.testing.assert_allclose(res_hist["loss"], full_hist["loss"], rtol=0, atol=1e-6)
    assert res_hist["doc"] == full_hist["doc"]
    for a, b in zip(jax.tree.leaves(res_state), jax.tree.leaves(full_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    # (learning itself: test_one_training_step_lowers_the_loss_on_a_fixed_batch; consecutive steps here
    # see different random documents, so their losses are not comparable)


def test_cli_help_and_errors(tmp_path, capsys):
    from train_qclassifier.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--model", "--corpus", "--heldout", "--buckets", "--hidden", "--steps", "--lr", "--min-distance",
                "--resume", "--eval-only", "--seed"):
        assert opt in out
    assert main(["--eval-only", "-o", str(tmp_path / "none")]) == 2
    assert "run_config.json" in capsys.readouterr().err


def test_cli_checks_paths_and_counts_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A bad run directory, corpus file or count is reported before the model loads (a model that
    does not exist is named here: loading it would be a different error)."""
    from train_qclassifier.__main__ import main

    doc = tmp_path / "doc.txt"
    doc.write_text("some text " * 50)
    (tmp_path / "adir").mkdir()
    missing_model = str(tmp_path / "none.gguf")
    cases = [(["--corpus", str(doc), "-o", str(doc)], f"-o {doc} exists and is not a directory"),
             (["--corpus", str(doc), "--eval-out", str(doc)], f"--eval-out {doc} exists and is not a directory"),
             (["--corpus", str(tmp_path / "adir")], "is a directory: name its text files"),
             (["--corpus", str(tmp_path / "nope.txt")], "nope.txt does not exist"),
             (["--corpus", str(doc), "--heldout", str(doc)], "held-out documents overlap the training corpus")]
    for argv, message in cases:
        run_dir = [] if "-o" in argv else ["-o", str(tmp_path / "run")]
        assert main([*argv, *run_dir, "--model", missing_model]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "none.gguf" not in err, (argv, err)   # the model was never loaded
    assert doc.read_text() == "some text " * 50 and not (tmp_path / "run").exists()
    for opt in ("--max-docs", "--max-heldout"):
        with pytest.raises(SystemExit) as e:
            main([opt, "0", "--model", missing_model])
        assert e.value.code == 2 and f"{opt} must be >= 1; got 0" in capsys.readouterr().err
