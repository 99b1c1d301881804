"""The import structure of ``vitblocks``: no module of the package imports back a module that imports it, directly
or through others, and in ``vitblocks.models`` the surgery knows no backbone (read from the source with ``ast``,
function-level imports included)."""
import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

import vitblocks
import vitblocks.models

PACKAGE_DIR = Path(vitblocks.__file__).parent
MODELS_DIR = Path(vitblocks.models.__file__).parent
PACKAGE = 'vitblocks.models'
# the modules that swap blocks into backbones, and the slot protocol they read
SURGERY = ('surgery', 'residual_surgery', 'slots', 'timm_slots', 'residual_blocks')
BACKBONES = 'backbones'


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix('').parts)
    if parts[-1] == '__init__':
        parts = parts[:-1]
    return '.'.join([package, *parts])


def import_graph(root: Path, package: str) -> Dict[str, Set[str]]:
    """Module -> the modules of ``package`` (the tree at ``root``) it imports anywhere in its source.

    ``from X import a`` is an import of ``X.a`` where that is a module of the package, else of ``X``; relative
    imports are resolved against the importing module's package."""
    files = {_module_name(p, root, package): p for p in root.rglob('*.py')}
    packages = {m for m, p in files.items() if p.name == '__init__.py'}
    graph: Dict[str, Set[str]] = {}
    for name, path in files.items():
        own_package = name if name in packages else name.rpartition('.')[0]
        targets: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = own_package.split('.')
                    base = base[:len(base) - (node.level - 1)]
                    source = '.'.join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ''
                for alias in node.names:
                    sub = f'{source}.{alias.name}'
                    targets.add(sub if sub in files else source)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle ``[a, b, ..., a]`` of ``graph``, or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def reachable(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_surgery_imports_no_backbone():
    graph = import_graph(MODELS_DIR, PACKAGE)
    backbones = {m for m in graph if m == f'{PACKAGE}.{BACKBONES}' or m.startswith(f'{PACKAGE}.{BACKBONES}.')}
    assert len(backbones) == 8  # the package and its seven files: the test reads what it should
    for module in SURGERY:
        name = f'{PACKAGE}.{module}'
        assert name in graph, f'{name} is gone; update SURGERY'
        imported = reachable(graph, name) & backbones
        assert not imported, f'{name} imports the backbone module(s) {sorted(imported)} (directly or through ' \
                             f'another module); declare slots with models/slots.py register_slots instead'


def test_the_package_has_no_import_cycle():
    """Every module of every subpackage, the lazy imports inside functions included: a module that needs one
    which imports it back takes what it needs from a registry or a third module both import."""
    graph = import_graph(PACKAGE_DIR, 'vitblocks')
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the whole tree was read
    assert {'vitblocks.layers.iffn', 'vitblocks.cli.reproduce', 'vitblocks.models.surgery'} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f'import cycle: {" -> ".join(cycle)}; move what both need into a module below them ' \
                          f'(docs/architecture.md)'


def test_the_reproduction_targets_share_without_borrowing():
    """What the targets of ``vitblocks reproduce`` share is in ``reproduce/common.py``: no harness imports another
    one for it, and the evidence command does not import the main reproduce command."""
    graph = import_graph(PACKAGE_DIR, 'vitblocks')
    harnesses = ('vitblocks.reproduce.ninformer_table1', 'vitblocks.reproduce.blocks_benchmark')
    for harness in harnesses:
        assert 'vitblocks.reproduce.common' in graph[harness]
        others = set(harnesses) - {harness}
        assert not reachable(graph, harness) & others, f'{harness} imports {others}; share through reproduce.common'
    assert 'vitblocks.cli.reproduce' not in reachable(graph, 'vitblocks.cli.reproduce_evidence')


def _write(root: Path, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_checks_catch_a_lazy_cycle_and_a_backbone_import(tmp_path):
    """The checks above on a package that breaks both rules, the way models/ used to: a backbone imports
    the surgery inside a function, and the surgery imports the backbone at the top."""
    _write(tmp_path, {
        '__init__.py': '',
        'surgery.py': 'from .backbones.lvt import LVT\nfrom .slots import find_slots\n',
        'slots.py': 'import os\n',
        'backbones/__init__.py': 'from . import lvt\n',
        'backbones/lvt.py': 'from ..slots import find_slots\n\n\ndef build():\n    from ..surgery import swap_ffn\n',
    })
    graph = import_graph(tmp_path, 'pkg')
    assert graph['pkg.surgery'] == {'pkg.backbones.lvt', 'pkg.slots'}
    assert graph['pkg.backbones'] == {'pkg.backbones.lvt'}
    assert reachable(graph, 'pkg.surgery') >= {'pkg.backbones.lvt'}
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {'pkg.surgery', 'pkg.backbones.lvt'}
    assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': set()}) is None
