"""Test setup: run Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton decorates the kernels, i.e. before
nanscan.kernels.triton is first imported, hence here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A missing or stale compiled library would silently shrink the test matrix to the reference
# backend; refuse to run instead (NANSCAN_ALLOW_MISSING_LIBRARY=1 to test the reference alone).
from nanscan import _ops  # noqa: E402  (after TRITON_INTERPRET is set)

if _ops.LOAD_ERROR is not None and os.environ.get("NANSCAN_ALLOW_MISSING_LIBRARY") != "1":
    raise RuntimeError(f"nanscan tests need the compiled library: {_ops.LOAD_ERROR}")
