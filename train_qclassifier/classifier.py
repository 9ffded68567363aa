"""The SAAP query classifier f_q: model, inference contract, export and validated loading.

One MLP per (layer, KV head) (SAAP §6.1): ``Linear(d, hidden) -> BatchNorm -> ReLU ->
Linear(hidden, C) -> softmax``, on **de-roped** queries. Training stacks all (layer, KV head)
classifiers along one leading axis (`stacked_classifiers`, `nnx.vmap`) and trains them in one
jitted step; the export and `TrainedClassifier.params` use leading axes ``[layers, Hkv]``.

Inference contract (used by `sqjax.methods.Saap`):

    clf = load_classifier(path)          # TrainedClassifier
    clf.unit_centroids                   # [layers, Hkv, C, d] offline key centroids (unit norm)
    clf.params                           # pytree; every leaf [layers, Hkv, ...]
    bucket_distribution(jax.tree.map(lambda a: a[layer], clf.params), q_pre)   # -> [Hkv, T, C]

`bucket_distribution` is a pure jitted function: query head ``h`` belongs to KV head
``h // g`` (g = Hq / Hkv, the layout of `models.attention`), each query head's softmax over the C
buckets is computed with BatchNorm in inference mode (running statistics) and the g
distributions of a group are summed (SAAP §5 "batched queries"), so each row sums to g.

Export format (a directory, written atomically: temp dir + rename):

    classifier.safetensors   unit_centroids, linear1.kernel/bias, bn.scale/bias/mean/var,
                             linear2.kernel/bias (float32, leading axes [layers, Hkv])
    config.json              format, version, shapes (num_layers, num_heads, num_kv_heads,
                             head_dim, n_buckets, hidden, bn_epsilon), the model it was trained
                             for, training summary, sha256 of the tensor file
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FORMAT = "sqjax-saap-qclassifier"
VERSION = 1
BN_EPSILON = 1e-5
TENSOR_FILE = "classifier.safetensors"
CONFIG_FILE = "config.json"


class ClassifierFormatError(ValueError):
    """A classifier export is missing, corrupted or does not match what it declares/was asked for."""


# --------------------------------------------------------------------------------------------
# The NNX module (training) and its stacked form
# --------------------------------------------------------------------------------------------


class QueryClassifier(nnx.Module):
    """f_q for one (layer, KV head): de-roped query [N, d] -> bucket logits [N, C].

    BatchNorm normalises over the N queries of the batch in training mode
    (``use_running_average=False``) and uses running statistics after ``.eval()``.
    """

    def __init__(self, head_dim: int, hidden: int, n_buckets: int, *, bn_momentum: float = 0.9,
                 rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(head_dim, hidden, rngs=rngs)
        self.bn = nnx.BatchNorm(hidden, momentum=bn_momentum, epsilon=BN_EPSILON, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, n_buckets, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(nnx.relu(self.bn(self.linear1(x))))


def stacked_classifiers(n: int, head_dim: int, hidden: int, n_buckets: int, *, bn_momentum: float = 0.9,
                        seed: int = 0) -> QueryClassifier:
    """`n` independent classifiers whose variables are stacked along a leading axis of size n."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return QueryClassifier(head_dim, hidden, n_buckets, bn_momentum=bn_momentum, rngs=rngs)

    return create(nnx.Rngs(seed))


def params_from_states(params_state, stats_state) -> dict[str, Any]:
    """Merge NNX Param and BatchStat states (pure dicts or `nnx.State`) into the export pytree."""
    p = nnx.to_pure_dict(params_state) if isinstance(params_state, nnx.State) else params_state
    s = nnx.to_pure_dict(stats_state) if isinstance(stats_state, nnx.State) else stats_state
    return {
        "linear1": {"kernel": p["linear1"]["kernel"], "bias": p["linear1"]["bias"]},
        "bn": {"scale": p["bn"]["scale"], "bias": p["bn"]["bias"], "mean": s["bn"]["mean"], "var": s["bn"]["var"]},
        "linear2": {"kernel": p["linear2"]["kernel"], "bias": p["linear2"]["bias"]},
    }


# --------------------------------------------------------------------------------------------
# Inference (pure function, the contract of sqjax.methods.Saap)
# --------------------------------------------------------------------------------------------


def _mlp_logits(params: dict[str, Any], x: jax.Array) -> jax.Array:
    """Per-KV-head MLP in inference mode.  params leaves [Hkv, ...], x [Hkv, N, d] -> [Hkv, N, C]."""
    l1, bn, l2 = params["linear1"], params["bn"], params["linear2"]
    h = jnp.einsum("knd,kdh->knh", x, l1["kernel"].astype(jnp.float32)) + l1["bias"][:, None, :]
    mul = jax.lax.rsqrt(bn["var"].astype(jnp.float32) + BN_EPSILON) * bn["scale"]
    h = (h - bn["mean"][:, None, :]) * mul[:, None, :] + bn["bias"][:, None, :]
    h = jax.nn.relu(h)
    return jnp.einsum("knh,khc->knc", h, l2["kernel"].astype(jnp.float32)) + l2["bias"][:, None, :]


@jax.jit
def bucket_distribution(params: dict[str, Any], q_pre: jax.Array) -> jax.Array:
    """Σ over each group's g query heads of softmax(f_q(q_h)).

    params: one layer's classifier pytree, every leaf [Hkv, ...] (``tree.map(lambda a: a[layer])``)
    q_pre:  [Hq, T, d] de-roped queries (any float dtype; computed in float32)
    returns float32 [Hkv, T, C]; each row sums to g = Hq / Hkv.
    """
    if q_pre.ndim != 3:
        raise ValueError(f"q_pre must have shape [Hq, T, d]; got {tuple(q_pre.shape)}")
    w1 = params["linear1"]["kernel"]
    if w1.ndim != 3:
        raise ValueError(f"linear1.kernel must be [Hkv, d, hidden] (one layer); got {tuple(w1.shape)}")
    hkv, d, _ = w1.shape
    hq, t, dq = q_pre.shape
    if dq != d:
        raise ValueError(f"q_pre head dim {dq} != classifier input dim {d}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of the classifier's KV heads ({hkv})")
    g = hq // hkv
    x = q_pre.astype(jnp.float32).reshape(hkv, g * t, d)  # head h -> KV head h // g
    probs = jax.nn.softmax(_mlp_logits(params, x), axis=-1)
    return probs.reshape(hkv, g, t, -1).sum(axis=1)


# --------------------------------------------------------------------------------------------
# Export / load
# --------------------------------------------------------------------------------------------

TENSOR_NAMES = ("unit_centroids", "linear1.kernel", "linear1.bias", "bn.scale", "bn.bias", "bn.mean",
                "bn.var", "linear2.kernel", "linear2.bias")


def expected_shapes(num_layers: int, num_kv_heads: int, head_dim: int, n_buckets: int, hidden: int) -> dict[str, tuple]:
    lk = (num_layers, num_kv_heads)
    return {
        "unit_centroids": lk + (n_buckets, head_dim),
        "linear1.kernel": lk + (head_dim, hidden),
        "linear1.bias": lk + (hidden,),
        "bn.scale": lk + (hidden,),
        "bn.bias": lk + (hidden,),
        "bn.mean": lk + (hidden,),
        "bn.var": lk + (hidden,),
        "linear2.kernel": lk + (hidden, n_buckets),
        "linear2.bias": lk + (n_buckets,),
    }


def flatten_params(params: dict[str, Any]) -> dict[str, np.ndarray]:
    return {f"{a}.{b}": np.asarray(v, np.float32) for a, sub in params.items() for b, v in sub.items()}


def unflatten_params(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, dict[str, Any]] = {}
    for name, v in flat.items():
        a, b = name.split(".", 1)
        out.setdefault(a, {})[b] = v
    return out


@dataclasses.dataclass(frozen=True)
class TrainedClassifier:
    """A loaded export: what `sqjax.methods.Saap(classifier=PATH)` consumes."""

    unit_centroids: jax.Array   # [layers, Hkv, C, d]
    params: dict[str, Any]      # leaves [layers, Hkv, ...]
    config: dict[str, Any]      # config.json

    @property
    def num_layers(self) -> int:
        return int(self.config["num_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config["num_kv_heads"])

    @property
    def n_buckets(self) -> int:
        return int(self.config["n_buckets"])

    def layer_params(self, layer: int) -> dict[str, Any]:
        return jax.tree.map(lambda a: a[layer], self.params)

    def check_compatible(self, *, num_layers: int | None = None, num_heads: int | None = None,
                         num_kv_heads: int | None = None, head_dim: int | None = None,
                         n_buckets: int | None = None) -> None:
        """Raise `ClassifierFormatError` naming every field that differs from the given model shape."""
        want = {"num_layers": num_layers, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
                "head_dim": head_dim, "n_buckets": n_buckets}
        bad = [f"{k}: classifier has {self.config[k]}, expected {v}" for k, v in want.items()
               if v is not None and int(self.config[k]) != int(v)]
        if bad:
            raise ClassifierFormatError("classifier does not match the model: " + "; ".join(bad))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_replace_dir(tmp: Path, target: Path) -> None:
    """Move the finished directory `tmp` to `target`, replacing an existing one (never half-written)."""
    target = Path(target)
    backup = None
    if target.exists():
        backup = target.with_name(f".{target.name}.old-{os.getpid()}")
        if backup.exists():
            shutil.rmtree(backup)
        os.replace(target, backup)
    try:
        os.replace(tmp, target)
    except BaseException:
        if backup is not None:
            os.replace(backup, target)
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    _fsync_dir(target.parent)


def export_classifier(path: str | os.PathLike, unit_centroids, params: dict[str, Any], *,
                      num_heads: int, model_info: dict[str, Any] | None = None,
                      training: dict[str, Any] | None = None) -> Path:
    """Write the export directory `path` atomically (temp dir in the same parent + rename)."""
    from safetensors.numpy import save_file

    path = Path(path)
    unit = np.asarray(unit_centroids, np.float32)
    if unit.ndim != 4:
        raise ValueError(f"unit_centroids must be [layers, Hkv, C, d]; got {unit.shape}")
    num_layers, hkv, c, d = unit.shape
    flat = flatten_params(params)
    hidden = flat["linear1.kernel"].shape[-1]
    tensors = {"unit_centroids": unit, **flat}
    shapes = expected_shapes(num_layers, hkv, d, c, hidden)
    for name, shape in shapes.items():
        if name not in tensors:
            raise ValueError(f"export is missing tensor {name}")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor {name} has shape {tensors[name].shape}, expected {shape}")
    if num_heads % hkv:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({hkv})")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tfile = tmp / TENSOR_FILE
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tfile),
                  metadata={"format": FORMAT, "version": str(VERSION)})
        os.chmod(tfile, 0o644)
        config = {
            "format": FORMAT, "version": VERSION,
            "num_layers": num_layers, "num_heads": int(num_heads), "num_kv_heads": hkv,
            "head_dim": d, "n_buckets": c, "hidden": int(hidden), "bn_epsilon": BN_EPSILON,
            "tensors": {k: list(v) for k, v in shapes.items()},
            "sha256": _sha256(tfile),
            "model": model_info or {}, "training": training or {},
        }
        with open(tmp / CONFIG_FILE, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        atomic_replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _resolve_export_dir(path: Path) -> Path:
    if (path / TENSOR_FILE).exists() or (path / CONFIG_FILE).exists():
        return path
    if (path / "classifier" / CONFIG_FILE).exists():  # a training run directory
        return path / "classifier"
    return path


def load_classifier(path: str | os.PathLike, *, num_layers: int | None = None, num_heads: int | None = None,
                    num_kv_heads: int | None = None, head_dim: int | None = None,
                    n_buckets: int | None = None) -> TrainedClassifier:
    """Load and validate an export directory (or a training run directory holding ``classifier/``).

    Checks: both files present; config.json is this format/version with positive integer shape
    fields; the tensor file's sha256 matches config.json (catches truncation and corruption);
    the tensor names are exactly the expected ones; every shape agrees with (layers, Hkv, C, d,
    hidden); values are finite; centroids have unit norm; optionally (keyword arguments) that the
    shapes match a model. Every failure raises `ClassifierFormatError` naming what mismatches.
    """
    from safetensors.numpy import load_file

    p = Path(path)
    if not p.exists():
        raise ClassifierFormatError(f"classifier path {p} does not exist")
    p = _resolve_export_dir(p)
    cfile, tfile = p / CONFIG_FILE, p / TENSOR_FILE
    for f in (cfile, tfile):
        if not f.is_file():
            raise ClassifierFormatError(f"{p} is not a classifier export: missing {f.name}")
    try:
        config = json.loads(cfile.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ClassifierFormatError(f"{cfile}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ClassifierFormatError(f"{cfile}: format is {config.get('format') if isinstance(config, dict) else None!r}, expected {FORMAT!r}")
    if config.get("version") != VERSION:
        raise ClassifierFormatError(f"{cfile}: version {config.get('version')!r} is not supported (expected {VERSION})")
    fields = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "n_buckets", "hidden")
    for k in fields:
        v = config.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ClassifierFormatError(f"{cfile}: {k} must be a positive int, got {v!r}")
    if config["num_heads"] % config["num_kv_heads"]:
        raise ClassifierFormatError(
            f"{cfile}: num_heads ({config['num_heads']}) is not a multiple of num_kv_heads ({config['num_kv_heads']})")
    if config.get("bn_epsilon") != BN_EPSILON:
        raise ClassifierFormatError(f"{cfile}: bn_epsilon {config.get('bn_epsilon')!r} != {BN_EPSILON} (this loader's BatchNorm)")
    digest = _sha256(tfile)
    if config.get("sha256") != digest:
        raise ClassifierFormatError(
            f"{tfile} is corrupted or was replaced: sha256 {digest[:16]}… does not match config.json's "
            f"{str(config.get('sha256'))[:16]}…")
    try:
        tensors = load_file(str(tfile))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types on bad files
        raise ClassifierFormatError(f"{tfile}: cannot read tensors ({type(e).__name__}: {e})") from None
    shapes = expected_shapes(config["num_layers"], config["num_kv_heads"], config["head_dim"],
                             config["n_buckets"], config["hidden"])
    missing = sorted(set(shapes) - set(tensors))
    extra = sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise ClassifierFormatError(f"{tfile}: missing tensors {missing}, unexpected tensors {extra}")
    bad = [f"{k} has shape {tuple(tensors[k].shape)}, expected {v} "
           f"(layers={config['num_layers']}, Hkv={config['num_kv_heads']}, C={config['n_buckets']}, "
           f"d={config['head_dim']}, hidden={config['hidden']})"
           for k, v in shapes.items() if tuple(tensors[k].shape) != v]
    if bad:
        raise ClassifierFormatError(f"{tfile}: " + "; ".join(bad))
    for k, v in tensors.items():
        if v.dtype != np.float32:
            raise ClassifierFormatError(f"{tfile}: tensor {k} has dtype {v.dtype}, expected float32")
        if not np.all(np.isfinite(v)):
            raise ClassifierFormatError(f"{tfile}: tensor {k} has non-finite values")
    if np.any(tensors["bn.var"] < 0):
        raise ClassifierFormatError(f"{tfile}: bn.var has negative entries")
    norms = np.linalg.norm(tensors["unit_centroids"], axis=-1)
    if not np.allclose(norms, 1.0, atol=1e-3):
        raise ClassifierFormatError(f"{tfile}: unit_centroids are not unit-norm (norms in [{norms.min():.4g}, {norms.max():.4g}])")
    clf = TrainedClassifier(
        unit_centroids=jnp.asarray(tensors["unit_centroids"]),
        params=jax.tree.map(jnp.asarray, unflatten_params({k: v for k, v in tensors.items() if k != "unit_centroids"})),
        config=config,
    )
    clf.check_compatible(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, n_buckets=n_buckets)
    return clf
