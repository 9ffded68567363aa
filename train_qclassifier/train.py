"""Training loop: all (layer, KV head) classifiers in one jitted step, Orbax checkpoints.

* The F = layers × Hkv classifiers are one stacked NNX module (`stacked_classifiers`); the step
  vmaps `nnx.merge(graphdef, params_f, stats_f)(x_f)` over F (no Python loop over heads), in
  BatchNorm training mode, and applies one Optax Adam update to the stacked parameters.
* Objective: Σ over heads of the row-mean KL(target ‖ f_q) (`targets.kl_loss`); summing rather
  than averaging keeps each head's gradient independent of how many heads there are. The
  reported loss is the mean over heads. Heads without a long-range query in the step's
  document are left out (zero weight, BatchNorm statistics unchanged).
* Checkpoints (`orbax.checkpoint.CheckpointManager`, synchronous, atomic: Orbax writes a temp
  directory and renames it) every `ckpt_every` steps, at the end and on KeyboardInterrupt;
  they hold the parameters, BatchNorm statistics, optimizer state, step and the loss history,
  so a resumed run continues at the same step with the same batches (`TrainingSet.batch` is a
  function of (seed, step)) and reproduces the uninterrupted loss curve and parameters.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from train_qclassifier.classifier import params_from_states, stacked_classifiers
from train_qclassifier.config import TrainConfig
from train_qclassifier.data import TrainingSet, save_json_atomic
from train_qclassifier.targets import kl_loss


class CheckpointMismatchError(ValueError):
    """Existing checkpoints do not belong to this run configuration."""


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Adam with a constant (optionally warmed-up) or warmup+cosine learning rate."""
    if cfg.schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup, 0), max(cfg.steps, cfg.warmup + 1),
                                                   end_value=cfg.lr * 0.01)
    elif cfg.warmup > 0:
        sched = optax.linear_schedule(0.0, cfg.lr, cfg.warmup)
    else:
        sched = cfg.lr
    return optax.adam(sched)


class Trainer:
    """Holds the stacked model's graphdef, the optimizer and the jitted step."""

    def __init__(self, cfg: TrainConfig, *, n_heads: int, head_dim: int, n_buckets: int):
        self.cfg = cfg
        self.n_heads, self.head_dim, self.n_buckets = n_heads, head_dim, n_buckets
        model = stacked_classifiers(n_heads, head_dim, cfg.hidden, n_buckets, bn_momentum=cfg.bn_momentum, seed=cfg.seed)
        graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        self.graphdef = graphdef
        self._init_params = nnx.to_pure_dict(params)
        self._init_stats = nnx.to_pure_dict(stats)
        self.tx = make_optimizer(cfg)
        self.step_fn = jax.jit(self._step)
        self.loss_fn = jax.jit(self._eval_loss)

    def init_state(self) -> dict[str, Any]:
        params = jax.tree.map(jnp.asarray, self._init_params)
        return {"params": params, "batch_stats": jax.tree.map(jnp.asarray, self._init_stats),
                "opt_state": self.tx.init(params), "step": jnp.int32(0), "last_loss": jnp.float32(jnp.nan)}

    # -- the jitted pieces --------------------------------------------------------------------

    def _head_losses(self, params, stats, x, t):
        graphdef = self.graphdef

        def per_head(p, s, xh, th):
            m = nnx.merge(graphdef, p, s)
            logits = m(xh)  # BatchNorm in training mode: batch statistics, running stats updated
            return kl_loss(th, logits), nnx.to_pure_dict(nnx.state(m, nnx.BatchStat))

        return jax.vmap(per_head)(params, stats, x, t)

    def _step(self, state, x, t, head_valid):
        w = head_valid.astype(jnp.float32)

        def objective(params):
            losses, new_stats = self._head_losses(params, state["batch_stats"], x, t)
            return jnp.sum(losses * w), (losses, new_stats)

        (_, (losses, new_stats)), grads = jax.value_and_grad(objective, has_aux=True)(state["params"])
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        keep = lambda new, old: jnp.where(head_valid.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
        stats = jax.tree.map(keep, new_stats, state["batch_stats"])
        loss = jnp.sum(losses * w) / jnp.maximum(jnp.sum(w), 1.0)
        return {"params": params, "batch_stats": stats, "opt_state": opt_state, "step": state["step"] + 1,
                "last_loss": loss}

    def _eval_loss(self, state, x, t, head_valid):
        """Mean-over-heads loss of a batch in training mode, without updating anything."""
        w = head_valid.astype(jnp.float32)
        losses, _ = self._head_losses(state["params"], state["batch_stats"], x, t)
        return jnp.sum(losses * w) / jnp.maximum(jnp.sum(w), 1.0)

    def export_params(self, state) -> dict[str, Any]:
        """Stacked [F, ...] training state -> export pytree with leaves [F, ...] (reshape to [L, Hkv] by caller)."""
        return params_from_states(state["params"], state["batch_stats"])

    # -- checkpoints ----------------------------------------------------------------------------

    def _manager(self, ckpt_dir: Path):
        import orbax.checkpoint as ocp

        opts = ocp.CheckpointManagerOptions(max_to_keep=3, create=True, enable_async_checkpointing=False)
        return ocp.CheckpointManager(Path(ckpt_dir).absolute(), options=opts)

    def _save(self, mgr, state, history) -> None:
        import orbax.checkpoint as ocp

        step = int(state["step"])
        if step in mgr.all_steps():
            return
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), history=ocp.args.JsonSave(history)))
        mgr.wait_until_finished()

    def _restore(self, mgr, step: int):
        import orbax.checkpoint as ocp

        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self.init_state())
        r = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     history=ocp.args.JsonRestore()))
        return r.state, dict(r.history)

    # -- the loop -------------------------------------------------------------------------------

    def fit(self, data: TrainingSet, ckpt_dir: str | Path, *, resume: bool = False, progress: bool = True,
            callback: Callable[[int, float], None] | None = None, metrics_path: str | Path | None = None,
            extra_metrics: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Train to ``cfg.steps``; returns (state, history). See the module docstring for resume.

        `callback(step_done, loss)` runs after every step (tests raise KeyboardInterrupt from it
        to simulate an interruption: the state is checkpointed and the interrupt re-raised).
        """
        cfg = self.cfg
        if (data.n_heads, data.head_dim, data.n_buckets) != (self.n_heads, self.head_dim, self.n_buckets):
            raise ValueError(f"training data has (F, d, C) = {(data.n_heads, data.head_dim, data.n_buckets)}, "
                             f"trainer {(self.n_heads, self.head_dim, self.n_buckets)}")
        mgr = self._manager(Path(ckpt_dir))
        try:
            latest = mgr.latest_step()
            if latest is not None and not resume:
                raise CheckpointMismatchError(
                    f"{ckpt_dir} already holds checkpoints (latest step {latest}); pass --resume to continue "
                    "that run, or choose a new output directory")
            if latest is not None:
                state, history = self._restore(mgr, latest)
            else:
                state, history = self.init_state(), {"loss": [], "seconds": [], "doc": []}
            start = int(state["step"])
            if start > cfg.steps:
                raise CheckpointMismatchError(f"checkpoint is at step {start} > --steps {cfg.steps}")
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=cfg.steps, initial=start, desc="train f_q", unit="step", dynamic_ncols=True)
            t_run = time.perf_counter()
            n_new = 0
            try:
                for step in range(start, cfg.steps):
                    batch = data.batch(step)
                    t0 = time.perf_counter()
                    state = self.step_fn(state, jnp.asarray(batch["x"]), jnp.asarray(batch["t"]),
                                         jnp.asarray(batch["head_valid"]))
                    loss = float(state["last_loss"])
                    dt = time.perf_counter() - t0
                    history["loss"].append(loss)
                    history["seconds"].append(dt)
                    history["doc"].append(int(batch["doc"]))
                    n_new += 1
                    if not math.isfinite(loss):
                        raise FloatingPointError(f"loss became {loss} at step {step + 1}")
                    if bar is not None:
                        qps = int(np.sum(batch["head_valid"])) * data.batch_queries / max(dt, 1e-9)
                        bar.set_postfix(loss=f"{loss:.4f}", qps=f"{qps:,.0f}")
                        bar.update(1)
                    done = step + 1
                    if done % cfg.ckpt_every == 0 or done == cfg.steps:
                        self._save(mgr, state, history)
                        if metrics_path is not None:
                            write_metrics(metrics_path, cfg, history, data, extra_metrics)
                    if callback is not None:
                        callback(done, loss)
            except KeyboardInterrupt:
                # keep state and history consistent: the step's loss is recorded with the state
                if len(history["loss"]) < int(state["step"]):
                    history["loss"].append(float(state["last_loss"]))
                    history["seconds"].append(None)
                    history["doc"].append(-1)
                self._save(mgr, state, history)
                if metrics_path is not None:
                    write_metrics(metrics_path, cfg, history, data, extra_metrics, interrupted=True)
                raise
            finally:
                if bar is not None:
                    bar.close()
            history["run_seconds"] = history.get("run_seconds", 0.0) + (time.perf_counter() - t_run)
            self._save(mgr, state, history)
            if metrics_path is not None:
                write_metrics(metrics_path, cfg, history, data, extra_metrics)
            return state, history
        finally:
            mgr.close()


def write_metrics(path, cfg: TrainConfig, history: dict[str, Any], data: TrainingSet | None,
                  extra: dict[str, Any] | None = None, interrupted: bool = False) -> None:
    secs = [s for s in history.get("seconds", []) if isinstance(s, float) and math.isfinite(s)]
    per_step_q = (data.n_heads * data.batch_queries) if data is not None else None
    out = {
        "config": cfg.to_dict(),
        "steps_done": len(history.get("loss", [])),
        "loss": history.get("loss", []),
        "doc": history.get("doc", []),
        "step_seconds_mean": float(np.mean(secs)) if secs else None,
        "queries_per_second": (per_step_q / float(np.mean(secs))) if secs and per_step_q else None,
        "interrupted": interrupted,
        **(extra or {}),
    }
    save_json_atomic(Path(path), json.loads(json.dumps(out, default=float)))
