"""Test setup: run Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton decorates the kernels, i.e. before
nanscan.kernels.triton is first imported, hence here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
