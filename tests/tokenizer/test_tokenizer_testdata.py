"""The committed test tokenizer is what `python -m devkit.build_testdata` builds, and loads through transformers."""
from __future__ import annotations

from transformers import AutoTokenizer

from devkit import build_testdata
from tokenizer import testdata


def test_committed_files_equal_a_fresh_build(tmp_path) -> None:
    written = build_testdata.build(tmp_path)
    assert {p.name for p in written} == {"tokenizer.json", "tokenizer_config.json"}
    for fresh in written:
        committed = testdata.path() / fresh.name
        assert committed.read_bytes() == fresh.read_bytes(), f"{fresh.name} is stale: run python -m devkit.build_testdata"


def test_loads_with_transformers_offline() -> None:
    tok = AutoTokenizer.from_pretrained(str(testdata.path()), local_files_only=True)
    assert 1000 <= len(tok) <= 4096
    for special in build_testdata.SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(special) < 3
    assert tok.chat_template == build_testdata.CHAT_TEMPLATE
    ids = tok("hello there, <|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "hello there, <|im_end|>"
