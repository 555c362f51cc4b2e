"""Known-intentional non-finite values: the ``allow=`` patterns :func:`nanscan.watch` and
:func:`nanscan.replay` share -- how they are given and how a name matches them. Torch-free."""
from __future__ import annotations

from fnmatch import fnmatchcase


def check_allow(allow, where: str) -> tuple:
    """``allow`` as a tuple of fnmatch patterns (one pattern or an iterable of them); anything else is
    a ``TypeError`` from ``where`` saying what is accepted."""
    if isinstance(allow, str):
        return (allow,)
    try:
        patterns = tuple(allow)
    except TypeError:
        patterns = None
    if patterns is None or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{where}: allow must be an fnmatch pattern (str) or an iterable of them, e.g. "
                        f"allow=('*.attn_mask',), got {allow!r}"[:300])
    return patterns


def name_allowed(name: str, patterns) -> bool:
    """``name`` (a module path, ``"blocks.0.attn[0]"``, ``"fc (output grad)"``) matches one of ``patterns``."""
    return any(fnmatchcase(name, p) for p in patterns)
