"""kvgate's two compiled modules; everything else is declared in pyproject.toml.

- kvcache._native, the prefix index's hot loops: kvcache/csrc/, one file per part, compiled as one
  translation unit through module.c (which includes the others: see its head comment for why), so the
  other files are `depends` (a change to any of them rebuilds it).
- tokenizer._scanner, the word-cached encoder's pre-tokenizer scanner: tokenizer/_scanner.c.

Both build with -Wall -Wextra and must build without a warning (`./dev sanitize` adds -Werror)."""
from glob import glob

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra"]
NATIVE_PARTS = sorted(p for p in glob("kvcache/csrc/*.[ch]") if p != "kvcache/csrc/module.c")

setup(ext_modules=[
    Extension("kvcache._native", ["kvcache/csrc/module.c"], depends=NATIVE_PARTS, extra_compile_args=FLAGS),
    Extension("tokenizer._scanner", ["tokenizer/_scanner.c"], extra_compile_args=FLAGS),
])
