"""Python-side kernels: ``reference`` (pure PyTorch, the oracle) and ``triton`` (GPU, or CPU under
``TRITON_INTERPRET=1``). Imported lazily by :mod:`nanscan._ops`; nothing here is loaded at
``import nanscan``."""
