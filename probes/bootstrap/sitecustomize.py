"""Loaded by every Python process started with this directory on PYTHONPATH (diagnose run).

Waits for `torch` to be imported by the user's script, then installs the probes.
Never raises: a probe must not stop a job from starting.

This directory holds this file only, and the probes are loaded from the absolute path in
DIAGNOSE_PROBE_PKG under a private module name: nothing of the tool's install (site-packages, a
checkout) is put ahead of the user's own PYTHONPATH, and no module of the user's named `probes`,
`reports` or `diagnose` is shadowed or imported by mistake.
"""
import importlib.abc
import importlib.util
import importlib.machinery
import os
import sys

_PRIVATE_NAME = "_diagnose_probes"


def _chain_previous_sitecustomize():
    """Keep a sitecustomize that was on the path after ours working."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if entry and os.path.abspath(entry) != here and os.path.isfile(os.path.join(entry, "sitecustomize.py")):
            try:
                spec = importlib.util.spec_from_file_location("_user_sitecustomize", os.path.join(entry, "sitecustomize.py"))
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
            except Exception:  # noqa: BLE001
                pass
            return


def _load_probes():
    """The probes package from its absolute path; its modules import each other relatively."""
    if _PRIVATE_NAME in sys.modules:
        return sys.modules[_PRIVATE_NAME]
    pkg = os.environ["DIAGNOSE_PROBE_PKG"]
    spec = importlib.util.spec_from_file_location(_PRIVATE_NAME, os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_PRIVATE_NAME] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[_PRIVATE_NAME]
        raise
    return mod


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Runs the probe install right after `torch` finishes importing."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            try:
                _load_probes().install_from_env()
            except Exception as exc:  # noqa: BLE001
                sys.stderr.write(f"diagnose probe: not installed ({exc}); training continues\n")

        loader.exec_module = exec_module
        return spec


if os.environ.get("DIAGNOSE_PROBE_DIR") and os.environ.get("DIAGNOSE_PROBE_PKG") and "torch" not in sys.modules:
    sys.meta_path.insert(0, _AfterTorchImport())
_chain_previous_sitecustomize()
