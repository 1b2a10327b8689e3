"""Build the project's small test tokenizer: `python -m devkit.build_testdata [DIR]`.

A byte-level BPE (~2k tokens) trained with the `tokenizers` library on text this
module generates itself from a fixed seed, with ChatML turn markers as special
tokens and a ChatML chat template. The output is deterministic, so the files
committed under tokenizer/testdata/ can be checked against a fresh build.
"""
from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_SEED = 20261129
_LINES = 6000

# ChatML with tools (as a system block) and an optional `enable_thinking` kwarg.
# transformers renders with trim_blocks/lstrip_blocks, so every newline is an explicit literal.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- 'You may call these tools:\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message.get('tool_calls') -%}{{- '\\n' + (message['tool_calls'] | tojson) -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "th", "ch", "pr", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "ck"]
_PUNCT = [".", ",", "?", "!", ":", ";", " -", "..."]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))


def _line(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.7:
        words = [_word(rng) for _ in range(rng.randint(3, 18))]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        text = " ".join(words) + rng.choice(_PUNCT)
    elif kind < 0.85:
        text = json.dumps({_word(rng): rng.randint(0, 10**rng.randint(1, 6)), "type": _word(rng), "ok": rng.random() < 0.5})
    else:
        text = f"def {_word(rng)}({_word(rng)}, {_word(rng)}):\n    return {_word(rng)} + {rng.randint(0, 999)}"
    return text


def corpus(seed: int = _SEED, lines: int = _LINES) -> Iterator[str]:
    """The deterministic training text."""
    rng = random.Random(seed)
    for _ in range(lines):
        yield _line(rng)


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    decoder = {}
    for text in SPECIAL_TOKENS:
        decoder[str(tok.token_to_id(text))] = {
            "content": text, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build(out: Path) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json into `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    tok = train()
    files = {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config(tok), indent=2, sort_keys=True) + "\n",
    }
    written = []
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else Path(__file__).parent / "testdata"
    for path in build(out):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
