"""SAAP query-classifier training (Mazaré et al. 2025, §4, App. A) for sqjax.

    python -m train_qclassifier -o runs/smollm2 --steps 400 --lr 1e-3 --schedule cosine
    sqjax.methods.Saap(classifier="runs/smollm2/classifier")

Modules: `config` (TrainConfig), `corpus` (documents), `data` (activations -> k-means ->
long-range targets -> batches), `targets` (attention-mass targets, long-range filter, KL loss),
`classifier` (NNX model, `bucket_distribution`, export / `load_classifier`), `train` (jitted
step over all heads, Orbax checkpoints), `evaluate` (recall vs selectivity on held-out docs).
Heavy imports (flax, orbax, the model) happen inside the modules, not here.
"""

__all__ = ["load_classifier", "bucket_distribution", "TrainedClassifier", "TrainConfig"]


def __getattr__(name):
    if name in ("load_classifier", "bucket_distribution", "TrainedClassifier"):
        from train_qclassifier import classifier

        return getattr(classifier, name)
    if name == "TrainConfig":
        from train_qclassifier.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'train_qclassifier' has no attribute {name!r}")
