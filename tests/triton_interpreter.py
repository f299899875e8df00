"""Triton's interpreter for the fused kernels' tests on a machine without CUDA.

Without CUDA the kernels run on CPU tensors in Triton's interpreter, which needs
``TRITON_INTERPRET=1`` before Triton is imported. Triton decides when it is imported
whether its own library kernels (``tl.randn``) are interpreted, and in a whole-suite run
it has been imported before (``torch._dynamo`` and ``transformers`` import it, as does
building a ``torch.optim`` optimizer): its Python modules are then imported again,
interpreted (the compiled extension, ``triton._C``, stays loaded).

A test module calls :func:`use_interpreter` before it imports Triton or a kernel module.
"""

from __future__ import annotations

import os
import sys

import torch

#: whether the kernels run compiled on a GPU (else interpreted on the CPU)
CUDA = torch.cuda.is_available()


def use_interpreter() -> bool:
    """Switch Triton to its interpreter where there is no CUDA; returns :data:`CUDA`."""
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
            if not name.startswith("triton._C"):
                del sys.modules[name]
    return CUDA
