"""Equality of two ways to compute the same thing, as strict as the device allows.

On the CPU a chunked or batched evaluation gives the unchunked one's bits (the same
kernels run on each slice). On CUDA the matrix-product library picks its kernel by the
shape, so a chunk of 3 members and a batch of 4 may round differently: there the two
must agree to a few units in the last place, not bit for bit.
"""

from __future__ import annotations

import torch
from torch.testing import assert_close


def assert_same_up_to_kernels(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.device.type == "cpu":
        assert torch.equal(actual, expected)
    else:
        eps = torch.finfo(actual.dtype).eps
        assert_close(actual, expected, rtol=8 * eps, atol=8 * eps)
