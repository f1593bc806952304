"""Who may import whom (docs/architecture.md, "Import rules"): read off the source with `ast`, every
import statement counted, those inside functions included.

- `contract/` (wire messages, codec, errors, SSE, etcd, enrollment, dialects, Worker/View, CLI kit)
  imports nothing of the project;
- `policies/` imports `contract/` only (a policy sees a `View`, never the gateway);
- `mesh/` (the gateway) imports `contract/` and `policies/`, never `workers/` or `demo/`;
- `workers/` imports `contract/`, never `mesh/` or `policies/`;
- `demo/` (the supervisor that starts both sides) may import any of them.
The `mesh` console script finds each side's subcommands through the `atomesh.commands` entry points
(names, not imports): that is how the gateway's CLI reaches `workers.cli` without importing it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("contract", "mesh", "policies", "workers", "demo", "bench", "tests")
ALLOWED = {
    "contract": {"contract"},
    "policies": {"policies", "contract"},
    "mesh": {"mesh", "contract", "policies"},
    "workers": {"workers", "contract"},
    "demo": {"demo", "mesh", "contract", "policies", "workers"},
}


def imported_packages(source: str, module: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import of a project package in `source`, relative
    imports resolved against `module` (dotted name of the file)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: the file's own package, `level` steps up
                base = module.split(".")[:-node.level]
                names = [".".join([*base, node.module] if node.module else base)]
            else:
                names = [node.module or ""]
        else:
            continue
        for n in names:
            top = n.split(".")[0]
            if top in PROJECT:
                out.append((node.lineno, top))
    return out


def violations(package: str, files: list[Path]) -> list[str]:
    bad = []
    for f in files:
        module = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        for line, top in imported_packages(f.read_text(), module):
            if top not in ALLOWED[package]:
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {top}")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_rules(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    assert violations(package, files) == []


def test_the_rule_catches_a_forbidden_import(tmp_path: Path) -> None:
    """The checker itself: a worker module importing the gateway (absolute, or nested in a function)
    is reported; relative imports resolve inside their own package."""
    assert imported_packages("def f():\n    from mesh.proxy import Proxy\n", "workers.x") == [(2, "mesh")]
    assert imported_packages("import mesh.app as a\n", "workers.x") == [(1, "mesh")]
    assert imported_packages("from ..engine import dist\n", "workers.kv.x") == [(1, "workers")]
    assert imported_packages("from . import holder\n", "workers.kv.x") == [(1, "workers")]
    assert imported_packages("import json, orjson\n", "contract.x") == []
    f = ROOT / "workers" / "__probe_never_written__.py"   # a path under workers/, its text given
    bad = [f"{f.relative_to(ROOT)}:{ln} imports {top}"
           for ln, top in imported_packages("from mesh.config import MeshConfig\n", "workers.x")
           if top not in ALLOWED["workers"]]
    assert bad == ["workers/__probe_never_written__.py:1 imports mesh"]


def test_every_type_ignore_says_why() -> None:
    """mypy runs strict (pyproject's [tool.mypy]); where a line must be excused, it says why: after
    the ignore on the same line, or on the line above as `# (type: ignore below) why`."""
    bad = []
    for package in ("contract", "mesh", "policies", "workers"):
        for f in sorted((ROOT / package).rglob("*.py")):
            lines = f.read_text().splitlines()
            for i, line in enumerate(lines):
                at = line.find("# type: ignore")
                if at < 0:
                    continue
                rest = line[at + len("# type: ignore"):]
                said_here = rest.startswith("[") and "]  # " in rest
                said_above = i > 0 and "# (type: ignore below) " in lines[i - 1]
                if not rest.startswith("[") or not (said_here or said_above):
                    bad.append(f"{f.relative_to(ROOT)}:{i + 1}")
    assert bad == []
