"""What each part of the tree may import (DESIGN.md's rules of the import graph, read from the
source with ``ast``), and what importing a service really loads (a fresh interpreter each)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "demo", "pbsd", "proto", "services", "worldgen")
SERVICES = ("rollout", "scorer", "trainer", "tools")
COMPOSITION_ROOTS = ("pbsd.cli", "demo")  # they wire the parts together and may import everything
PUBLISHED_CLIENT = "services.tools.client"  # the one crossing between services: rollout -> gateway
PURE = ("pbsd.credit", "pbsd.losses", "pbsd.verifier")


def _sources() -> dict[str, tuple[str, bool]]:
    """Every module of the project: name -> (source, whether it is a package's __init__)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if init else parts)] = (path.read_text(), init)
    return out


def _imports(name: str, source: str, init: bool, known: set[str]) -> set[str]:
    """Every project module ``name`` imports, at the top or inside a function."""
    package = name if init else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # "from services.tools import client" imports a module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _service(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" and parts[1] in SERVICES else None


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    out = []
    for name, (source, init) in sources.items():
        if _within(name, COMPOSITION_ROOTS):
            continue
        for imported in sorted(_imports(name, source, init, set(sources))):
            if _within(imported, COMPOSITION_ROOTS):
                out.append(f"{name} imports {imported}: nothing but the CLI and the demo wires the parts")
            # the wire contracts take the paper's defaults from the pure algorithm, which imports nothing
            if name.startswith("proto") and not (imported.startswith("proto") or _within(imported, PURE)):
                out.append(f"{name} imports {imported}: proto imports nothing of the project but itself")
            if _within(name, PURE) and imported.startswith("services"):
                out.append(f"{name} imports {imported}: the algorithm imports no service, bus or model code")
            target, source_service = _service(imported), _service(name)
            if target is None or target == source_service:
                continue
            if source_service == "rollout" and imported == PUBLISHED_CLIENT:
                continue
            who = f"the {source_service} service" if source_service else "shared code"
            out.append(f"{name} imports {imported}: {who} may not import the {target} service")
    return out


def test_the_import_graph_follows_the_design():
    assert _violations(_sources()) == []


def test_the_import_graph_check_catches_each_kind_of_crossing():
    """The check itself, on crossings this tree once had and others it must refuse."""
    planted = {
        "services.rollout.runner": "from services.tools.gateway import ToolGateway",
        "worldgen.oracle": "from services.tools.backends import OfflineBackend",
        "services.model.tiny": "def f():\n    from services.tools import catalogue",
        "services.scorer.worker": "from ..trainer import policy",
        "proto.runs": "import services.bus",
        "proto.messages": "from pbsd.cli import app",
        "pbsd.credit": "from services.model import checkpoint",
        "services.trainer.api": "from demo import run",
    }
    sources = {**_sources(), **{name: (code, False) for name, code in planted.items()}}
    found = _violations(sources)
    for name in planted:
        assert any(v.startswith(f"{name} imports") for v in found), name
    assert not any(v.startswith("services.rollout.worker") for v in found)  # the published client


def _loaded(modules: list[str], stand_in_jax: Path, extra: str = "") -> set[str]:
    """The project and library modules a fresh interpreter holds after importing ``modules``."""
    code = textwrap.dedent(
        f"""
        import importlib, json, pkgutil, sys
        for name in {modules!r}:
            module = importlib.import_module(name)
            if hasattr(module, "__path__"):  # a package: every module in it
                for info in pkgutil.walk_packages(module.__path__, name + "."):
                    importlib.import_module(info.name)
        """
    )
    code += extra + "\nprint(json.dumps(sorted(sys.modules)))\n"
    env = {"PYTHONPATH": f"{stand_in_jax}:{ROOT}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def stand_in_jax(tmp_path_factory) -> Path:
    """A package named ``jax`` ahead of everything on the path: whatever imports JAX (as
    ``import bm25s`` does where it is installed) imports this one, and it shows in sys.modules.
    JAX itself is no dependency of the project and is not installed here."""
    root = tmp_path_factory.mktemp("stand-in-jax")
    (root / "jax").mkdir()
    (root / "jax" / "__init__.py").write_text("")
    (root / "jax" / "lax.py").write_text("def top_k(x, k):\n    return x[:k], list(range(k))\n")
    return root


def _unwanted(loaded: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if _within(m, prefixes))


def test_the_trainer_and_scorer_load_no_search_index_and_no_jax(stand_in_jax):
    loaded = _loaded(["services.trainer", "services.scorer"], stand_in_jax)
    assert "services.trainer.app" in loaded and "services.scorer.app" in loaded
    assert _unwanted(loaded, ("bm25s", "jax", "services.search", "services.tools", "services.rollout")) == []


def test_the_rollout_loads_the_gateway_client_only(stand_in_jax):
    loaded = _loaded(["services.rollout"], stand_in_jax)
    assert PUBLISHED_CLIENT in loaded
    assert _unwanted(loaded, ("bm25s", "jax", "services.search", "services.tools.gateway")) == []


def test_the_gateway_never_starts_jax_or_torch(stand_in_jax, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"url": "kb://a", "title": "Alpha", "text": "Alpha is a river."}) + "\n")
    search = (
        "from services.search.corpus import OfflineCorpus\n"
        f"assert OfflineCorpus.from_jsonl({str(corpus)!r}).search('alpha')[0].link == 'kb://a'\n"
    )
    loaded = _loaded(["services.tools", "services.search"], stand_in_jax, extra=search)
    assert "bm25s" in loaded  # it uses the index, on NumPy
    assert _unwanted(loaded, ("jax", "torch", "transformers", "services.rollout", "services.trainer")) == []
