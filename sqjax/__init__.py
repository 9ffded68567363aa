"""sqjax: Squeezed Attention and its peers (QUEST, SnapKV, SAAP) for fixed-context LLM inference.

    import sqjax
    model = sqjax.load_model("smollm2-135m")
    ctx = sqjax.FixedContext.build(model, document, sqjax.methods.Squeezed(sparsity=0.9))
    print(ctx.ask("What does this module do?"))
"""

from sqjax import methods
from sqjax.methods import (
    ContextData, Full, HierarchicalSqueezed, Oracle, Quest, Saap, SnapKV, Squeezed, StreamingLLM,
)

__version__ = "0.1.0"

__all__ = [
    "methods", "ContextData", "Full", "Squeezed", "HierarchicalSqueezed", "Quest", "SnapKV",
    "StreamingLLM", "Oracle", "Saap", "load_model", "FixedContext", "__version__",
]


def load_model(name_or_path: str = "smollm2-135m", **kwargs):
    """Load a Llama-family model: "smollm2-135m", a Hugging Face checkpoint dir, or a .gguf file."""
    from models.registry import load_model as _load

    return _load(name_or_path, **kwargs)


def __getattr__(name):
    if name == "FixedContext":  # imported lazily: it pulls in the model stack
        from sqjax.fixed_context import FixedContext

        return FixedContext
    raise AttributeError(f"module 'sqjax' has no attribute {name!r}")
