"""The import rules each package's docstring states, checked on the source tree (no import is run).

kvcache/ and tokenizer/ import no other kvgate package; routing/ may import kvcache/ and tokenizer/, never
plugin/; the serving packages never import the development ones (sim/, devkit/, bench/); inside routing/,
each sub-package imports only routing's core modules and the sub-packages its docstring names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KVGATE = {"plugin", "routing", "kvcache", "tokenizer", "sim", "devkit", "bench"}
DEVELOPMENT = {"sim", "devkit", "bench"}
# package -> the kvgate packages it may import (itself always)
ALLOWED = {
    "kvcache": set(),
    "tokenizer": set(),
    "routing": {"kvcache", "tokenizer"},
    "plugin": {"kvcache", "tokenizer", "routing"},
}
ROUTING_CORE = {"routing", "routing.pods", "routing.registry", "routing.errors", "routing.metrics",
                "routing.background"}
# routing sub-package -> the other routing sub-packages it may import
ROUTING_ALLOWED = {
    "discovery": set(),
    "state": set(),
    "learning": set(),
    "scheduling": {"state", "learning"},
}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, relative ones resolved against its package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # `from routing import scheduling` names a sub-package too
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names
                      if module in ("routing",) and alias.name in ROUTING_ALLOWED]
    return found


def sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_serving_package_imports_only_what_its_docstring_allows(package: str) -> None:
    wrong = []
    for path in sources(package):
        for line, module in imports(path):
            top = module.split(".")[0]
            if top in KVGATE and top != package and top not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not wrong, f"{package}/ may import only {sorted(ALLOWED[package]) or 'no other kvgate package'}:\n" + \
        "\n".join(wrong)


def test_no_serving_package_imports_a_development_one() -> None:
    wrong = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for package in ALLOWED for path in sources(package)
             for line, module in imports(path) if module.split(".")[0] in DEVELOPMENT]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("sub", sorted(ROUTING_ALLOWED))
def test_a_routing_sub_package_imports_the_core_and_what_its_docstring_names(sub: str) -> None:
    wrong = []
    for path in sources(f"routing/{sub}"):
        for line, module in imports(path):
            parts = module.split(".")
            if parts[0] != "routing" or module in ROUTING_CORE:
                continue
            other = parts[1] if len(parts) > 1 else ""
            if other != sub and other not in ROUTING_ALLOWED[sub]:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not wrong, (f"routing/{sub}/ may import routing's core modules and "
                       f"{sorted(ROUTING_ALLOWED[sub]) or 'no other sub-package'}:\n" + "\n".join(wrong))


def test_the_rules_see_imports_at_all() -> None:
    """A checker that finds no import anywhere would pass every rule above."""
    found = {module for path in sources("plugin") for _, module in imports(path)}
    assert {"routing.router", "routing.registry", "kvcache.index"} <= found
