"""The statistics behind :mod:`samplers_as_optim.diagnostics`: split and nested R-hat, and ESS.

The definitions are the diagnostics module's (its docstring gives the equations); this
module computes them for many quantities at once: the samples are checked, split into
half-chains, rank-normalised (:mod:`samplers_as_optim.samples.ranks`) and reduced chunk by
chunk of quantities, so memory stays bounded. It also checks the diagnostics' other inputs
(stacked weights, predictions, R-hat values). Its functions are the diagnostics'
internals: use :mod:`samplers_as_optim.diagnostics`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from ..core.validation import check_choice, check_chunk_size
from .ranks import normal_scores, sort_values

__all__ = [
    "RHAT_METHODS",
    "check_predictions",
    "check_samples",
    "check_stacked",
    "combine_rhat",
    "compute",
    "linear_quantile",
    "rhat_names",
    "rhat_of",
    "rhat_tensors",
    "superchain_order",
    "worst_per_input",
]

#: the R-hat methods (``diagnostics.rhat``'s ``method``)
RHAT_METHODS: tuple[str, ...] = ("rank", "bulk", "folded", "split")

_MIN_DRAWS = 4  # two draws per half-chain, as ArviZ requires
_CHUNK_ELEMENTS = 2**21  # draws per chunk and thread when chunk_size is None (8-16 MB a buffer)
_LAG_STAGES = (4, 8, 16)  # lags computed directly, for fewer quantities each time, before FFT
_RESOLUTION = float(torch.finfo(torch.float64).resolution)  # ArviZ's "constant" test


# --------------------------------------------------------------------------- validation


def check_samples(
    samples: object, *, min_chains: int, purpose: str, name: str = "samples"
) -> Tensor:
    """``samples`` as a real tensor ``[chains, draws, *quantities]``, or a clear error."""
    if not isinstance(samples, Tensor):
        raise TypeError(
            f"Invalid {name}: {type(samples).__name__} (expected a torch.Tensor laid out "
            "[chains, draws, *quantities])"
        )
    if samples.dim() < 2:
        raise ValueError(
            f"Invalid {name}: shape {tuple(samples.shape)} (expected at least 2 dimensions, "
            "[chains, draws, *quantities])"
        )
    if samples.is_complex():
        raise TypeError(f"Invalid {name}: dtype {samples.dtype} (expected real numbers)")
    chains, draws = samples.shape[:2]
    if chains < min_chains:
        raise ValueError(
            f"Invalid {name}: {chains} chain(s) (expected at least {min_chains} for "
            f"{purpose}; the layout is [chains, draws, *quantities])"
        )
    if draws < _MIN_DRAWS:
        raise ValueError(
            f"Invalid {name}: {draws} draws per chain (expected at least {_MIN_DRAWS}, so "
            "that each half of a split chain has 2 draws)"
        )
    samples = samples.detach()
    if not samples.is_floating_point():
        samples = samples.to(torch.float64)  # integers and bools: exact in float64
    return samples


def check_stacked(stacked: object) -> None:
    """Refuse what is not a non-empty dict of tensors sharing ``[chains, draws]``."""
    if not isinstance(stacked, Mapping) or not all(
        isinstance(value, Tensor) for value in stacked.values()
    ):
        raise TypeError(
            f"Invalid stacked: {type(stacked).__name__} (expected a dict of tensors laid out "
            "[chains, draws, *parameter_shape])"
        )
    if not stacked:
        raise ValueError("Invalid stacked: {} (expected at least one parameter)")
    leading = {name: tuple(tensor.shape[:2]) for name, tensor in stacked.items()}
    if len(set(leading.values())) != 1:
        raise ValueError(
            f"Invalid stacked: leading shapes {leading} (expected every tensor to share "
            "[chains, draws])"
        )


def check_predictions(predictions: object) -> None:
    """Refuse a tensor of predictions with fewer than 3 dimensions (no test-input axis)."""
    if isinstance(predictions, Tensor) and predictions.dim() < 3:
        raise ValueError(
            f"Invalid predictions: shape {tuple(predictions.shape)} (expected "
            "[chains, draws, B, *outputs], at least 3 dimensions)"
        )


def rhat_tensors(rhat_values: object) -> list[Tensor]:
    """The tensors of R-hat values given as a tensor or a dict of them, or a clear error."""
    if isinstance(rhat_values, Tensor):
        return [rhat_values]
    if isinstance(rhat_values, Mapping) and all(
        isinstance(value, Tensor) for value in rhat_values.values()
    ):
        return list(rhat_values.values())
    raise TypeError(
        f"Invalid rhat_values: {type(rhat_values).__name__} (expected a tensor or a dict "
        "of tensors)"
    )


def superchain_order(superchains: object, chains: int, device: torch.device) -> tuple[Tensor, int]:
    """Split-chain permutation grouping superchains contiguously, and their number."""
    if isinstance(superchains, bool):
        raise TypeError(
            f"Invalid superchains: {superchains!r} (expected a number of superchains or one "
            "superchain id per chain)"
        )
    if isinstance(superchains, int):
        count = superchains
        if count < 2 or chains % count:
            raise ValueError(
                f"Invalid superchains: {count} (expected a divisor of the number of chains, "
                f"{chains}, that is at least 2)"
            )
        ids = torch.arange(chains).div(chains // count, rounding_mode="floor")
    else:
        try:
            ids = torch.as_tensor(superchains)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"Invalid superchains: {superchains!r} (expected a number of superchains or "
                "one integer superchain id per chain)"
            ) from None
        if (
            ids.dim() != 1
            or ids.numel() != chains
            or ids.is_floating_point()
            or (ids.is_complex() or ids.dtype == torch.bool)
        ):
            raise ValueError(
                f"Invalid superchains: {superchains!r} (expected {chains} integer ids, one per "
                "chain)"
            )
        _, ids, counts = torch.unique(ids.cpu(), return_inverse=True, return_counts=True)
        if counts.numel() < 2 or bool((counts != counts[0]).any()):
            raise ValueError(
                f"Invalid superchains: {superchains!r} (expected at least 2 superchains, each "
                "with the same number of chains)"
            )
        count = counts.numel()
    split_ids = torch.cat([ids, ids])  # half-chains: first halves, then second halves
    order = torch.sort(split_ids, stable=True).indices
    return order.to(device), count


# --------------------------------------------------------------------------- kernels


class _ChainStats(NamedTuple):
    """Per-half-chain summaries shared by R-hat and ESS."""

    mean: Tensor  # [q, M] float64
    squares: Tensor  # [q, M] float64, sum over draws of (theta - mean)^2
    centred: Tensor  # [q, M, N] theta - mean, in the computation dtype


def _chain_stats(values: Tensor) -> _ChainStats:
    mean = values.mean(dim=-1, keepdim=True)
    centred = values - mean
    squares = torch.linalg.vecdot(centred, centred).to(torch.float64)
    return _ChainStats(mean.squeeze(-1).to(torch.float64), squares, centred)


def _rhat_statistic(stats: _ChainStats) -> Tensor:
    """Split-R-hat (eqs. 1-4) from half-chain statistics, in float64."""
    n = stats.centred.shape[-1]
    between = n * stats.mean.var(dim=-1)
    within = (stats.squares / (n - 1)).mean(dim=-1)
    return ((between / within + n - 1) / n).sqrt()


def _nested_statistic(stats: _ChainStats, order: Tensor, superchains: int) -> Tensor:
    """Nested R-hat from half-chain statistics, half-chains grouped by ``order``."""
    q, m, n = stats.centred.shape
    shape = (q, superchains, m // superchains)
    chain_mean = stats.mean[:, order].view(shape)
    chain_var = (stats.squares[:, order] / (n - 1)).view(shape)
    between_superchains = chain_mean.mean(dim=-1).var(dim=-1)
    within_superchains = (chain_mean.var(dim=-1) + chain_var.mean(dim=-1)).mean(dim=-1)
    return (1 + between_superchains / within_superchains).sqrt()


def _fast_fft_size(n: int) -> int:
    """Smallest 2-, 3- and 5-smooth integer >= n."""
    while True:
        m = n
        for factor in (2, 3, 5):
            while m % factor == 0:
                m //= factor
        if m == 1:
            return n
        n += 1


def _lag_sums(centred: Tensor, start: int, stop: int) -> Tensor:
    r""":math:`\sum_m \sum_t d_{t,m} d_{t+k,m}` for lags ``start <= k < stop``, in float64."""
    n = centred.shape[-1]
    columns = [
        torch.linalg.vecdot(centred[..., : n - k], centred[..., k:]).sum(dim=-1)
        for k in range(start, stop)
    ]
    return torch.stack(columns, dim=-1).to(torch.float64)


def _lag_sums_fft(centred: Tensor) -> Tensor:
    """All lags of :func:`_lag_sums` at once, by FFT (zero-padded to >= 2N)."""
    n = centred.shape[-1]
    size = _fast_fft_size(2 * n)
    spectrum = torch.fft.rfft(centred, n=size, dim=-1)
    power = spectrum.real.square() + spectrum.imag.square()
    sums: Tensor = torch.fft.irfft(power, n=size, dim=-1)[..., :n].sum(dim=-2)
    return sums.to(torch.float64)


def _geyer_tau(rho: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Geyer's initial monotone sequence estimate of the integrated autocorrelation time.

    Args:
        rho: ``[q, L]`` combined autocorrelations at lags ``0..L-1`` (``rho[:, 0]`` is
            replaced by 1, as in the reference implementation).
        n: half-chain length (the loop bound of the reference implementation).

    Returns:
        ``(tau, complete)``: ``complete`` is False where the sequence may continue past the
        available lags (those rows need more lags); ``tau`` is valid where it is True.
    """
    rho = rho.clone()
    rho[:, 0] = 1.0
    pairs = rho.shape[-1] // 2
    pair_sums = rho[:, 0 : 2 * pairs : 2] + rho[:, 1 : 2 * pairs : 2]
    # The reference loop runs iteration j (pair j) for j = 1, 2, ... while 2j - 1 < n - 3 and
    # all earlier pair sums are positive.
    max_iterations = max(0, (n - 3) // 2)
    all_positive = torch.cummin((pair_sums > 0).to(torch.int8), dim=-1).values.bool()
    usable = min(max_iterations, pairs - 1)
    iterations = all_positive[:, :usable].sum(dim=-1)
    complete = torch.ones_like(iterations, dtype=torch.bool)
    if max_iterations > pairs - 1:
        complete = ~all_positive[:, pairs - 1]
    monotone = torch.cummin(pair_sums, dim=-1).values.cumsum(dim=-1)
    last = (iterations - 1).clamp(min=0).unsqueeze(-1)
    kept = torch.where(iterations > 0, monotone.gather(-1, last).squeeze(-1), 0.0)
    even = rho.gather(-1, (2 * iterations).unsqueeze(-1)).squeeze(-1)
    final_pair = pair_sums.gather(-1, iterations.unsqueeze(-1)).squeeze(-1)
    extra = torch.where((final_pair >= 0) | (even > 0), even, 0.0)
    tau = -1.0 + 2.0 * kept + extra
    tau = torch.where(rho.isnan().any(dim=-1), math.nan, tau)
    return tau, complete


def _ess_statistic(
    values: Tensor, stats: _ChainStats | None = None, constant: Tensor | None = None
) -> Tensor:
    """ESS (eqs. 10, 12-13) of ``[q, M, N]`` half-chains, in float64.

    ``constant`` (bool ``[q]``) may be given when the caller already knows which quantities
    are constant; otherwise it is ArviZ's test ``max - min < resolution``.
    """
    q, m, n = values.shape
    total = m * n
    result = torch.full((q,), float(total), dtype=torch.float64, device=values.device)
    if constant is None:
        low, high = torch.aminmax(values.reshape(q, -1), dim=-1)
        constant = high.to(torch.float64) - low.to(torch.float64) < _RESOLUTION
    varying = ~constant  # constant quantities keep ESS = S, as in ArviZ
    if not bool(varying.any()):
        return result
    active = torch.nonzero(varying).squeeze(-1)
    stats = _chain_stats(values) if stats is None else stats
    if active.numel() < q:
        stats = _ChainStats(*(field[active] for field in stats))
    centred = stats.centred
    between = stats.mean.var(dim=-1)
    first = min(_LAG_STAGES[0], n)
    sums = torch.cat(
        [stats.squares.sum(dim=-1, keepdim=True), _lag_sums(centred, 1, first)], dim=-1
    )
    mean_var = sums[:, 0] / total * n / (n - 1)
    var_plus = mean_var * (n - 1) / n + between
    bound = 1.0 / math.log10(total)
    stages = iter([*(stop for stop in _LAG_STAGES[1:] if stop < n), None])  # None: FFT
    while True:
        rho = 1.0 - (mean_var.unsqueeze(-1) - sums / total) / var_plus.unsqueeze(-1)
        tau, complete = _geyer_tau(rho, n)
        if sums.shape[-1] >= n:
            complete = torch.ones_like(complete)
        result[active[complete]] = total / torch.clamp(tau[complete], min=bound)
        if bool(complete.all()):
            break
        keep = ~complete
        active, centred = active[keep], centred[keep]
        mean_var, var_plus = mean_var[keep], var_plus[keep]
        stop = next(stages)
        if stop is None:
            sums = _lag_sums_fft(centred)
        else:
            sums = torch.cat([sums[keep], _lag_sums(centred, sums.shape[-1], stop)], dim=-1)
    return result


def linear_quantile(sorted_values: Tensor, prob: float) -> Tensor:
    """NumPy's default ("linear") quantile of sorted rows, with NumPy's rounding."""
    n = sorted_values.shape[-1]
    virtual = (n - 1) * prob
    below = min(max(math.floor(virtual), 0), n - 1)
    above = min(below + 1, n - 1)
    weight = virtual - below
    low, high = sorted_values[:, below], sorted_values[:, above]
    diff = high - low
    if weight >= 0.5:
        return high - diff * (1 - weight)
    return low + diff * weight


# --------------------------------------------------------------------------- engine


class _Split(NamedTuple):
    """One chunk of quantities split into half-chains, NaN quantities zeroed."""

    block: Tensor  # [chains, draws, q] the chunk's draws, a contiguous copy
    split: Tensor  # [q, M, N] the half-chains, in the computation dtype
    rows: Tensor  # [q, M N] ``split``'s draws pooled per quantity
    finite: bool  # whether every draw is finite
    has_nan: Tensor  # [q] bool, the quantities with a NaN draw


def compute(
    samples: Tensor,
    wanted: set[str],
    *,
    prob: float = 0.05,
    nested: tuple[Tensor, int] | None = None,
    chunk_size: int | None = None,
) -> dict[str, Tensor]:
    """Run the requested statistics over every quantity, chunk by chunk.

    ``wanted`` holds names among ``rhat_bulk``, ``rhat_folded``, ``rhat_split``,
    ``ess_bulk``, ``ess_tail`` and ``ess_mean``. With ``nested`` = (order, count), the R-hat
    statistics are nested R-hat.
    """
    chains, draws = samples.shape[:2]
    trailing = samples.shape[2:]
    count = math.prod(trailing)
    dtype = torch.float64 if samples.dtype == torch.float64 else torch.float32
    device = samples.device
    flat = samples.reshape(chains, draws, count)
    results = {name: torch.empty(count, dtype=dtype, device=device) for name in wanted}
    if chunk_size is None:
        # Each torch kernel is a parallel region: give every thread about _CHUNK_ELEMENTS
        # draws so that synchronisation stays cheap next to the work (up to 4 threads' worth).
        threads = min(torch.get_num_threads(), 4) if device.type == "cpu" else 8
        chunk_size = max(1, _CHUNK_ELEMENTS * threads // (chains * draws))
    step = chunk_size
    for start in range(0, count, step):  # each chunk writes its slice of every result
        stop = min(count, start + step)
        part = _split_chunk(flat, start, stop, dtype)
        out, ordered = _score_statistics(part, wanted, nested)
        if wanted & {"rhat_split", "ess_mean"}:
            stats = _chain_stats(part.split)
            if "rhat_split" in wanted:
                out["rhat_split"] = _r_statistic(stats, nested)
            if "ess_mean" in wanted:
                out["ess_mean"] = _ess_statistic(part.split, stats)
        if "ess_tail" in wanted:
            out["ess_tail"] = _tail_ess(part, ordered, prob, dtype)
        for name, value in out.items():
            results[name][start:stop] = value.masked_fill(part.has_nan, math.nan).to(dtype)
    return {name: value.reshape(trailing) for name, value in results.items()}


def _r_statistic(stats: _ChainStats, nested: tuple[Tensor, int] | None) -> Tensor:
    """Split-R-hat, or nested R-hat with ``nested`` = (order, count)."""
    if nested is None:
        return _rhat_statistic(stats)
    return _nested_statistic(stats, *nested)


def _split_chunk(flat: Tensor, start: int, stop: int, dtype: torch.dtype) -> _Split:
    """Quantities ``start:stop`` of ``flat`` ``[chains, draws, count]`` as half-chains."""
    chains, draws = flat.shape[:2]
    half = draws // 2
    size = 2 * chains * half
    # Copy the chunk's slice first (contiguous runs), then transpose it in memory:
    # twice as fast as gathering [q, chains, draws] straight from the strided input.
    block = flat[:, :, start:stop].contiguous()
    q = stop - start
    split = torch.empty(q, 2, chains, half, dtype=dtype, device=flat.device)
    split[:, 0] = block[:, :half].permute(2, 0, 1)
    split[:, 1] = block[:, draws - half :].permute(2, 0, 1)
    split = split.view(q, 2 * chains, half)
    rows = split.view(q, size)
    finite = bool(rows.sum().isfinite()) or bool(rows.isfinite().all())  # sum: one pass
    has_nan = rows.isnan().any(dim=-1) if not finite else rows.new_zeros(q, dtype=torch.bool)
    if draws % 2:
        has_nan |= block[:, half].isnan().any(dim=0)
    if bool(has_nan.any()):
        split = split.masked_fill(has_nan.view(q, 1, 1), 0.0)
        rows = split.view(q, size)
    return _Split(block, split, rows, finite, has_nan)


def _score_statistics(
    part: _Split, wanted: set[str], nested: tuple[Tensor, int] | None
) -> tuple[dict[str, Tensor], Tensor | None]:
    """The rank-normalised statistics (bulk and folded R-hat, bulk-ESS) that are wanted.

    Returns them with the chunk's sorted draws (None when none is wanted).
    """
    out: dict[str, Tensor] = {}
    if not wanted & {"rhat_bulk", "rhat_folded", "ess_bulk"}:
        return out, None
    split, rows, size = part.split, part.rows, part.rows.shape[-1]
    scores, ordered = normal_scores(rows, finite=part.finite)
    scores = scores.view_as(split)
    stats = _chain_stats(scores)
    if "rhat_bulk" in wanted:
        out["rhat_bulk"] = _r_statistic(stats, nested)
    if "ess_bulk" in wanted:
        tied_throughout = ordered[:, 0] == ordered[:, -1]  # the only constant scores
        out["ess_bulk"] = _ess_statistic(scores, stats, tied_throughout)
    del scores, stats
    if "rhat_folded" in wanted:
        median = (ordered[:, size // 2 - 1] + ordered[:, size // 2]) / 2
        # |theta - median| <= max - min, so it is finite when that range is.
        range_finite = part.finite and bool((ordered[:, -1] - ordered[:, 0]).isfinite().all())
        folded, _ = normal_scores((rows - median.unsqueeze(-1)).abs(), finite=range_finite)
        out["rhat_folded"] = _r_statistic(_chain_stats(folded.view_as(split)), nested)
        del folded
    return out, ordered


def _tail_ess(part: _Split, ordered: Tensor | None, prob: float, dtype: torch.dtype) -> Tensor:
    """Tail-ESS: the smaller ESS of the ``prob`` and ``1 - prob`` quantile indicators.

    ``ordered``: the chunk's sorted half-chain draws if sorted already, else None. With an
    odd number of draws the quantiles are those of every draw, the middle one included.
    """
    block, split, has_nan = part.block, part.split, part.has_nan
    chains, draws, q = block.shape
    if draws % 2 == 1:
        full = block.permute(2, 0, 1).reshape(q, chains * draws).to(dtype)
        ordered = sort_values(full.masked_fill(has_nan.unsqueeze(-1), 0.0))
    elif ordered is None:
        ordered = sort_values(part.rows)
    ordered = ordered.to(split.device)
    tails = []
    for p in (prob, 1.0 - prob):
        indicator = (split <= linear_quantile(ordered, p).view(q, 1, 1)).to(dtype)
        stats = _chain_stats(indicator)
        fraction = stats.mean.mean(dim=-1)  # an indicator is constant iff 0 or 1
        constant = (fraction == 0) | (fraction == 1)
        tails.append(_ess_statistic(indicator, stats, constant))
    return torch.minimum(*tails)


def rhat_of(samples: object, method: str, chunk_size: object, *, name: str) -> Tensor:
    """R-hat of ``method`` for every quantity of ``samples`` (checked, named ``name``)."""
    samples = check_samples(samples, min_chains=2, purpose="R-hat", name=name)
    check_choice("method", method, RHAT_METHODS)
    results = compute(samples, rhat_names(method), chunk_size=check_chunk_size(chunk_size))
    return combine_rhat(results, method)


def worst_per_input(values: Tensor) -> Tensor:
    """The largest R-hat over each test input's outputs, ``[B]`` (NaN ignored, unless all)."""
    if values.dim() == 1:
        return values
    flat = values.reshape(values.shape[0], -1)
    worst = torch.where(flat.isnan(), -math.inf, flat).amax(dim=-1)
    return torch.where(flat.isnan().all(dim=-1), math.nan, worst)


def rhat_names(method: str) -> set[str]:
    """The statistics :func:`compute` computes for an R-hat ``method``."""
    return {
        "rank": {"rhat_bulk", "rhat_folded"},
        "bulk": {"rhat_bulk"},
        "folded": {"rhat_folded"},
        "split": {"rhat_split"},
    }[method]


def combine_rhat(results: Mapping[str, Tensor], method: str) -> Tensor:
    """The R-hat of ``method`` from the statistics :func:`compute` returned."""
    if method == "rank":
        # max() of two NaNs is NaN, and NaN only where both are (constant quantities).
        return torch.fmax(results["rhat_bulk"], results["rhat_folded"])
    return results[_RHAT_NAME[method]]


_RHAT_NAME = {"bulk": "rhat_bulk", "folded": "rhat_folded", "split": "rhat_split"}
