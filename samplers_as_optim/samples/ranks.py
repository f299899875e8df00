r"""Row-wise sorting, average ranks and normal scores: the one expensive step of rank diagnostics.

Everything here works on a matrix ``[rows, n]`` and treats each row independently.

Ranks need a sort, and the sort dominates the cost of rank-normalised R-hat and ESS.
``torch.sort`` on CPU is a scalar comparison sort (about 50 ns per element for rows of a
few thousand); NumPy >= 2 ships vectorised (AVX-512/AVX2) sorts that are 5-20 times
faster, so on CPU, when NumPy is importable, :func:`sort_rows` uses them:

* float32 rows are widened to float64, which leaves 29 zero bits at the bottom of every
  mantissa. The column index is written into those bits, so one *values-only* sort of
  float64 keys returns both the sorted values and the permutation (an argsort moves
  twice the data). Distinct float32 values stay ordered (their float64 images differ above
  bit 29), equal ones stay adjacent, and ``±inf`` is first mapped to ``±2**128`` so that the
  index bits cannot turn it into a NaN.
* float64 rows use NumPy's vectorised argsort.

Any other device or dtype uses ``torch.sort``. Both paths give identical results (ties may
be ordered differently, which average ranks do not see).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

try:  # NumPy is a torchopt dependency, but the package must not require it.
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only without NumPy
    _np = None  # type: ignore[assignment]

__all__ = ["average_ranks", "blom_scores", "normal_scores", "sort_rows", "sort_values"]

#: Use NumPy's vectorised sorts for CPU tensors (tests switch this off to check the
#: ``torch.sort`` path against it).
USE_NUMPY = _np is not None

_MAX_PACKED_COLUMNS = 2**29  # index bits available below a float32's float64 mantissa
_MIN_ROWS_PER_THREAD = 16


def _numpy_ok(y: Tensor) -> bool:
    return USE_NUMPY and y.device.type == "cpu" and y.dtype in (torch.float32, torch.float64)


def _in_row_blocks(rows: int, work: Callable[[slice], None]) -> None:
    """Run ``work`` on blocks of rows, in parallel over ``torch.get_num_threads()`` threads.

    NumPy's sorts and ufuncs release the GIL but run on one core; torch's own kernels are
    already parallel, so only this NumPy part is spread over threads.
    """
    workers = max(1, min(torch.get_num_threads(), rows // _MIN_ROWS_PER_THREAD))
    if workers == 1:
        work(slice(0, rows))
        return
    bounds = [rows * i // workers for i in range(workers + 1)]
    blocks = [slice(a, b) for a, b in itertools.pairwise(bounds)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(work, block) for block in blocks]:
            future.result()


def sort_values(y: Tensor) -> Tensor:
    """Sort each row of ``y`` ``[rows, n]`` ascending (values only)."""
    if _numpy_ok(y):
        out = y.detach().numpy().copy()
        _in_row_blocks(out.shape[0], lambda block: out[block].sort(axis=-1))
        return torch.from_numpy(out)
    return torch.sort(y, dim=-1).values


def sort_rows(y: Tensor, *, finite: bool = False) -> tuple[Tensor, Tensor]:
    """Sort each row of ``y`` ``[rows, n]`` ascending; return (values, int64 column order).

    ``values[i, k] == y[i, order[i, k]]``. ``y`` must hold no NaN (callers mask NaN rows);
    ``finite=True`` promises it holds no infinity either (skips a pass).
    """
    rows, n = y.shape
    if _numpy_ok(y) and y.dtype == torch.float32 and n <= _MAX_PACKED_COLUMNS:
        return _sort_rows_packed(y, finite=finite)
    if _numpy_ok(y):
        array = y.detach().numpy()
        order = _np.empty(array.shape, dtype=_np.int64)
        values = _np.empty_like(array)

        def work(block: slice) -> None:
            order[block] = _np.argsort(array[block], axis=-1)
            values[block] = _np.take_along_axis(array[block], order[block], axis=-1)

        _in_row_blocks(rows, work)
        return torch.from_numpy(values), torch.from_numpy(order)
    sorted_values, sorted_order = torch.sort(y, dim=-1)
    return sorted_values, sorted_order


def _sort_rows_packed(y: Tensor, *, finite: bool) -> tuple[Tensor, Tensor]:
    """float32 rows: index bits packed under the mantissa, one values-only float64 sort."""
    rows, n = y.shape
    mask = (1 << max(1, (n - 1).bit_length())) - 1
    array = y.detach().numpy()
    columns = _np.arange(n, dtype=_np.int64)
    values = _np.empty((rows, n), dtype=_np.float32)
    order = _np.empty((rows, n), dtype=_np.int64)

    def work(block: slice) -> None:
        keys = array[block].astype(_np.float64)
        if not finite:
            _np.clip(keys, -(2.0**128), 2.0**128, out=keys)  # only ±inf move; FLT_MAX < 2**128
        bits = keys.view(_np.int64)
        bits |= columns
        keys.sort(axis=-1)
        _np.bitwise_and(bits, mask, out=order[block])
        bits &= ~mask
        with _np.errstate(over="ignore"):  # ±2**128 -> ±inf again
            values[block] = keys

    _in_row_blocks(rows, work)
    return torch.from_numpy(values), torch.from_numpy(order)


def average_ranks(sorted_values: Tensor) -> Tensor:
    """1-based ranks of sorted rows, ties sharing the average of their positions.

    Args:
        sorted_values: ``[rows, n]``, each row ascending.

    Returns:
        float64 ``[rows, n]``: the rank of the element at each sorted position
        (``scipy.stats.rankdata(method="average")`` in sorted order).
    """
    rows, n = sorted_values.shape
    device = sorted_values.device
    position = torch.arange(n, device=device).expand(rows, n)
    new_group = torch.ones(rows, n, dtype=torch.bool, device=device)
    new_group[:, 1:] = sorted_values[:, 1:] != sorted_values[:, :-1]
    ends_group = torch.ones_like(new_group)
    ends_group[:, :-1] = new_group[:, 1:]
    start = torch.where(new_group, position, 0).cummax(dim=-1).values
    end = torch.where(ends_group, position, n - 1).flip(-1).cummin(dim=-1).values.flip(-1)
    return (start + end).to(torch.float64) / 2 + 1


def blom_scores(ranks: Tensor, n: int) -> Tensor:
    r"""Normal scores :math:`\Phi^{-1}((r - 3/8) / (n + 1/4))` of 1-based ranks (Blom, 1958)."""
    scores: Tensor = torch.special.ndtri((ranks - 0.375) / (n + 0.25))
    return scores


@functools.lru_cache(maxsize=8)
def _untied_scores(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    ranks = torch.arange(1, n + 1, dtype=torch.float64, device=device)
    return blom_scores(ranks, n).to(dtype)


def normal_scores(
    y: Tensor, *, dtype: torch.dtype | None = None, finite: bool = False
) -> tuple[Tensor, Tensor]:
    r"""Rank-normalise each row of ``y`` ``[rows, n]`` (Vehtari et al. 2021, eq. 14).

    .. math::
        z_i = \Phi^{-1}\!\left(\frac{r_i - 3/8}{n + 1/4}\right),

    with :math:`r_i` the average rank of :math:`y_i` within its row.

    Without ties the scores in sorted order are the same vector for every row, so they are
    scattered through the sort permutation; tie groups (common in float32 data) are then
    patched in place, at a cost proportional to the number of tied elements.

    Args:
        y: rows without NaN.
        dtype: dtype of the scores (default: ``y``'s); scores are computed in float64.
        finite: promise that ``y`` holds no infinity (see :func:`sort_rows`).

    Returns:
        ``(scores, sorted_values)``: the scores in ``y``'s layout and the sorted rows.
    """
    rows, n = y.shape
    dtype = y.dtype if dtype is None else dtype
    values, order = sort_rows(y, finite=finite)
    values, order = values.to(y.device), order.to(y.device)
    out = torch.empty(rows, n, dtype=dtype, device=y.device)
    out.scatter_(1, order, _untied_scores(n, dtype, y.device).expand(rows, n))
    row, pos = torch.nonzero(values[:, 1:] == values[:, :-1], as_tuple=True)
    if row.numel():
        # Sorted positions pos and pos + 1 tie; a tie group is a run of consecutive pos.
        new_run = torch.ones_like(pos, dtype=torch.bool)
        new_run[1:] = (row[1:] != row[:-1]) | (pos[1:] != pos[:-1] + 1)
        run = new_run.cumsum(0) - 1
        last_of_run = torch.ones_like(new_run)
        last_of_run[:-1] = new_run[1:]
        first, last = pos[new_run], pos[last_of_run] + 1
        group_rank = (first + last).to(torch.float64) / 2 + 1
        score = blom_scores(group_rank, n).to(dtype)[run]
        out[row, order[row, pos]] = score
        out[row, order[row, pos + 1]] = score
    return out, values
