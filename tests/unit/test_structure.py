"""``tools/structure.py`` (run by ``./dev lint``) fails on what it is there to catch: an
import circle, a class over 300 lines, a module over 600, an import of a layer above the
importer's and a module in no layer; and passes a package with none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "structure.py"


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, source in {"__init__.py": "", **files}.items():
        path = root / "pikku_celery" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def _structure(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), str(root)], capture_output=True,
                          text=True, timeout=60)


def _long_class(lines: int) -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    return f"class Big:\n{body}"


def test_a_circle_an_oversized_class_and_module_fail(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "model/__init__.py": "",
        "model/a.py": "from pikku_celery.model.b import B\n\nclass A:\n    pass\n",
        "model/b.py": "from pikku_celery.model import c\n\nB = 1\n",
        "model/c.py": "import pikku_celery.model.a\n",
        "model/sub/__init__.py": "",
        "model/sub/d.py": "from . import e\n",  # a relative circle inside a subpackage
        "model/sub/e.py": "from .d import x\n",
        "model/big.py": _long_class(301),
        "model/long.py": "x = 1\n" * 601,
    })
    done = _structure(root)
    assert done.returncode == 1, done.stdout
    lines = done.stdout.splitlines()
    assert ("import circle: pikku_celery.model.a <-> pikku_celery.model.b <-> "
            "pikku_celery.model.c") in lines
    assert "import circle: pikku_celery.model.sub.d <-> pikku_celery.model.sub.e" in lines
    assert "class pikku_celery.model.big.Big: 301 lines (> 300)" in lines
    assert "module pikku_celery.model.long: 601 lines (> 600)" in lines
    assert lines[-1].startswith("structure: 4 over the limits (2 import circles, 0 upward")


def test_an_import_of_a_higher_layer_and_a_module_in_none_fail(tmp_path: Path) -> None:
    """The model may not import the engine (by module, by a name in a folder's package, or
    relatively), the engine may not import the public face, and a new top-level module must
    be given a layer."""
    root = _package(tmp_path, {
        "app.py": "X = 1\n",
        "model/__init__.py": "",
        "model/records.py": "from pikku_celery.engine.passes import P\n",
        "model/keys.py": "from pikku_celery import engine\n",
        "model/views.py": "from ..worker import tasks\n",
        "engine/__init__.py": "",
        "engine/passes.py": "from pikku_celery import app\nfrom pikku_celery import X\nP = 1\n",
        "worker/__init__.py": "",
        "worker/tasks.py": "from pikku_celery.engine.passes import P\n",  # downward: fine
        "loose.py": "",
    })
    done = _structure(root)
    assert done.returncode == 1, done.stdout
    lines = done.stdout.splitlines()
    assert lines[:-1] == [
        "upward import: pikku_celery.engine.passes (layer 4) imports pikku_celery (layer 6)",
        "upward import: pikku_celery.engine.passes (layer 4) imports pikku_celery.app (layer 6)",
        "module pikku_celery.loose: in no layer of LAYERS",
        "upward import: pikku_celery.model.keys (layer 1) imports pikku_celery.engine (layer 4)",
        "upward import: pikku_celery.model.records (layer 1) imports "
        "pikku_celery.engine.passes (layer 4)",
        "upward import: pikku_celery.model.views (layer 1) imports "
        "pikku_celery.worker.tasks (layer 5)",
    ]
    assert lines[-1].startswith("structure: 6 over the limits (0 import circles, 5 upward")


def test_a_package_within_the_limits_passes(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "app.py": "from pikku_celery.model.a import B\n",  # the public face imports down
        "model/__init__.py": "",
        "model/a.py": "from pikku_celery.model.b import B\n",
        "model/b.py": "B = 1\n",
        "model/sub/__init__.py": "from pikku_celery.model.sub.d import D\n",  # its own module
        "model/sub/d.py": "from pikku_celery.model import sub\n\nD = 1\n",  # its own package
        "model/big.py": _long_class(300),
        "model/long.py": "x = 1\n" * 600,
    })
    done = _structure(root)
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines() == [
        "structure: 0 over the limits (0 import circles, 0 upward imports, largest module "
        "600 lines)"]
