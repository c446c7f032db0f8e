"""``tools/structure.py`` (run by ``./dev lint``) fails on what it is there to catch: an
import circle, a class over 300 lines, a module over 600, and passes a package with none."""

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
        "a.py": "from pikku_celery.b import B\n\nclass A:\n    pass\n",
        "b.py": "from pikku_celery import c\n\nB = 1\n",
        "c.py": "import pikku_celery.a\n",
        "sub/__init__.py": "",
        "sub/d.py": "from . import e\n",  # a relative circle inside a subpackage
        "sub/e.py": "from .d import x\n",
        "big.py": _long_class(301),
        "long.py": "x = 1\n" * 601,
    })
    done = _structure(root)
    assert done.returncode == 1, done.stdout
    lines = done.stdout.splitlines()
    assert "import circle: pikku_celery.a <-> pikku_celery.b <-> pikku_celery.c" in lines
    assert "import circle: pikku_celery.sub.d <-> pikku_celery.sub.e" in lines
    assert "class pikku_celery.big.Big: 301 lines (> 300)" in lines
    assert "module pikku_celery.long: 601 lines (> 600)" in lines
    assert lines[-1].startswith("structure: 4 over the limits (2 import circles,")


def test_a_package_within_the_limits_passes(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "a.py": "from pikku_celery.b import B\n",
        "b.py": "B = 1\n",
        "sub/__init__.py": "from pikku_celery.sub.d import D\n",  # its own module: no circle
        "sub/d.py": "from pikku_celery import sub\n\nD = 1\n",  # its own package: no edge
        "big.py": _long_class(300),
        "long.py": "x = 1\n" * 600,
    })
    done = _structure(root)
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines() == [
        "structure: 0 over the limits (0 import circles, largest module 600 lines)"]
