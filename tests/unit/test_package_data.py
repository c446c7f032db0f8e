"""Every file the package reads at run time that is not Python (the lease scripts, the
dashboard's templates, the type marker) is listed in pyproject's package data, so a wheel
carries it: an installed pikku-celery without its Lua scripts could not even import."""

from __future__ import annotations

import fnmatch
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest requires there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_data_file_of_the_package_is_shipped() -> None:
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    patterns = [f"{package.replace('.', '/')}/{glob}"
                for package, globs in listed.items() for glob in globs]
    data = [path.relative_to(ROOT).as_posix()
            for path in (ROOT / "pikku_celery").rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc")
            and "__pycache__" not in path.parts]
    assert any(p.endswith(".lua") for p in data)  # the scripts are files, as designed
    unshipped = [p for p in data if not any(fnmatch.fnmatch(p, pat) for pat in patterns)]
    assert unshipped == []
