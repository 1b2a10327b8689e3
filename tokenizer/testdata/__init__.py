"""The project's small test tokenizer (built by `python -m devkit.build_testdata`)."""
from __future__ import annotations

from pathlib import Path


def path() -> Path:
    """Directory holding tokenizer.json and tokenizer_config.json (with a ChatML chat template)."""
    return Path(__file__).parent
