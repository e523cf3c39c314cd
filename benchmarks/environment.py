"""What a run records about where it ran, and the float32 precision it sets for every column."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from typing import Any, Dict

import torch

import gtransform as gt

from .core import PRECISION, TOL_BF16, TOL_FP32


def environment(device: torch.device, opts: argparse.Namespace) -> Dict[str, Any]:
    meta: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gtransform": getattr(gt, "__version__", "?"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU",
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "argv": sys.argv,
        "quick": opts.quick,
        "repeats": opts.repeats,
        "target_s_per_repeat": opts.target_s,
        "tolerances": {"fp32": TOL_FP32, "bf16": TOL_BF16},
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        import jax

        meta["jax"] = jax.__version__
    except Exception:
        meta["jax"] = None
    for mod in ("transformers", "torchvision"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:
            meta[mod] = None
    try:  # identifies the gtransform sources even where the checkout has no .git (the device machine)
        import hashlib

        src = os.path.dirname(os.path.abspath(gt.__file__))
        h = hashlib.sha256()
        for fname in sorted(os.listdir(src)):
            if fname.endswith(".py"):
                with open(os.path.join(src, fname), "rb") as fh:
                    h.update(fname.encode() + b"\0" + fh.read())
        meta["gtransform_src_sha256"] = h.hexdigest()[:12]
    except Exception:
        meta["gtransform_src_sha256"] = None
    try:
        meta["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or None
    except Exception:
        meta["git"] = None
    return meta


def set_precision(tf32: bool) -> Dict[str, Any]:
    """float32 precision for every column, set once before anything runs.

    Through the legacy switches (torch.backends.cuda.matmul.allow_tf32,
    torch.backends.cudnn.allow_tf32) and set_float32_matmul_precision, which
    torch 2.9+ maps onto its new fp32_precision flags (read by inductor): using
    the new flags directly makes any later read of the legacy ones (by a library)
    raise. torch's own defaults differ between matmuls (no TF32) and cuDNN
    convolutions (TF32), hence both are set. jax: see import_jax."""
    PRECISION["tf32"] = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    got: Dict[str, Any] = {"tf32": tf32, "float32_matmul_precision": torch.get_float32_matmul_precision(),
                           "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                           "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                           "jax_default_matmul_precision": "tensorfloat32" if tf32 else "highest"}
    for name, obj in (("cuda.matmul.fp32_precision", getattr(torch.backends.cuda, "matmul", None)),
                      ("cudnn.conv.fp32_precision", getattr(torch.backends.cudnn, "conv", None))):
        try:
            got[name] = obj.fp32_precision
        except Exception:
            pass
    return got


def precision_text(p: Dict[str, Any]) -> str:
    if p.get("tf32"):
        return ("float32 precision: TF32 in every column (--tf32: cuda.matmul.allow_tf32 = cudnn.allow_tf32 = True, "
                "set_float32_matmul_precision('high'), jax_default_matmul_precision 'tensorfloat32')")
    return ("float32 precision: full (IEEE) in every column, no TF32: torch.backends.cuda.matmul.allow_tf32 = "
            "torch.backends.cudnn.allow_tf32 = False (torch defaults cuDNN convolutions to TF32), "
            "set_float32_matmul_precision('highest'), jax_default_matmul_precision 'highest'")
