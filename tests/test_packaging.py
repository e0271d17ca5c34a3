"""What a wheel installs: every package of the source tree, under the one import name.

An editable install finds a package that pyproject.toml forgets (the folder is on the path), so
the suite would pass while `pip install .` or a wheel from PyPI breaks at the first import: this
happened to diagnose.step. The list is read from pyproject.toml and compared with the folders.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    on_disk = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            on_disk.add(".".join([name, *rel.parts]))
    assert on_disk - listed == set(), f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"listed but not in the tree: {sorted(listed - on_disk)}"
