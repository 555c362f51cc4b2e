"""Build fingerprint shared by ``setup.py`` and the stale-library check in ``nanscan._ops``.

Kept free of torch imports so that ``setup.py`` can load it by path before torch's build helpers.
"""
import glob
import hashlib
import os


SOURCE_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")  # (csrc/README.md is no source)


def source_hash(root: str) -> str:
    """SHA-256 over the relative paths and bytes of every source file under ``root/csrc``."""
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "csrc", "**", "*"), recursive=True)):
        if os.path.isfile(path) and path.endswith(SOURCE_SUFFIXES):
            h.update(os.path.relpath(path, root).replace(os.sep, "/").encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()
