"""The conditions a step ran under: RNG states, environment, autocast, parameter dtypes and dtype policies."""
from __future__ import annotations

import platform
import random

import torch

from nanscan.capture.batch import _MAX_NOTED


def capture_rng() -> dict:
    """RNG states of python ``random``, numpy (if installed), torch CPU and every CUDA device, in
    a form ``weights_only`` loading accepts (tensors, numbers, strings, lists)."""
    version, internal, gauss = random.getstate()
    state: dict = {"python": [version, list(internal), gauss], "torch_cpu": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        state["numpy"] = None
    state["cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return state


def restore_rng(state: dict) -> None:
    """Inverse of :func:`capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch_cpu"])
    if state.get("numpy") is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def environment() -> dict:
    """Versions, device and the numerics-relevant backend flags."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine()),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def autocast_state() -> dict:
    """Autocast as it is now (call inside the step's autocast region to record it)."""
    out = {}
    for device_type in ("cpu", "cuda"):
        enabled = torch.is_autocast_enabled(device_type)
        out[device_type] = {"enabled": enabled,
                            "dtype": str(torch.get_autocast_dtype(device_type)).replace("torch.", "")}
    return out


def model_precision(model: torch.nn.Module) -> dict:
    """Parameter dtypes: tells a ``.half()`` / ``.to(bfloat16)`` model from an fp32 one under autocast."""
    counts: dict = {}
    for p in model.parameters():
        key = str(p.dtype).replace("torch.", "")
        counts[key] = counts.get(key, 0) + p.numel()
    out = {"param_dtypes": counts,
           "converted": sorted(k for k in counts if k in ("float16", "bfloat16"))}
    policies = _fsdp_mixed_precision(model)
    if policies:
        out["fsdp_mixed_precision"] = policies
    return out


def _fsdp_mixed_precision(model: torch.nn.Module) -> dict:
    """FSDP2's ``MixedPrecisionPolicy`` of every ``fully_shard``-ed module that sets one: the
    parameters are stored in their own dtype and all-gathered in ``param_dtype`` for compute, so
    ``param_dtypes`` alone would say fp32 for a step that ran in bf16. ``{module path: {field: value}}``."""
    out: dict = {}
    for name, module in model.named_modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        try:
            policy = state()._mp_policy
        except Exception:  # a torch whose FSDP keeps it elsewhere: nothing to record, nothing guessed
            continue
        fields = {}
        for field in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"):
            value = getattr(policy, field, None)
            fields[field] = str(value).replace("torch.", "") if isinstance(value, torch.dtype) else value
        if any(fields[f] is not None for f in ("param_dtype", "reduce_dtype", "output_dtype")):
            out[name or "(model)"] = fields
            if len(out) >= _MAX_NOTED:
                break
    return out
