"""The one compiled module, kvcache._native (the prefix index's hot loops); everything else is
declared in pyproject.toml. It builds with -Wall -Wextra and must build without a warning
(`./dev sanitize` adds -Werror)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("kvcache._native", ["kvcache/_native.c"],
                             extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"])])
