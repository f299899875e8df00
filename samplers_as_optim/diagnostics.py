r"""Convergence diagnostics at neural-network scale: rank-normalised R-hat, ESS, nested R-hat.

Every function takes samples laid out ``[chains, draws, *quantities]`` (ArviZ's layout) and
returns one value per quantity, shape ``quantities``, computed for all quantities at once in
torch, on the samples' device, in chunks of quantities so that memory stays bounded. The
definitions follow Vehtari et al. (2021) exactly as ArviZ (``arviz-stats``) implements them;
the tests check agreement to 1e-6.

Notation: chains are split in half (the middle draw is dropped when the number of draws is
odd), giving :math:`M` half-chains of :math:`N` draws, :math:`S = MN` draws in all;
:math:`\theta^{(nm)}` is draw :math:`n` of half-chain :math:`m`.

**Split-R-hat** (Vehtari et al. 2021, eqs. 1-4):

.. math::
    B = \frac{N}{M-1}\sum_m (\bar\theta^{(\cdot m)} - \bar\theta^{(\cdot\cdot)})^2, \qquad
    W = \frac{1}{M}\sum_m s_m^2, \qquad
    \widehat{R} = \sqrt{\frac{\frac{N-1}{N}W + \frac{1}{N}B}{W}},

with :math:`s_m^2` the unbiased variance of half-chain :math:`m`.

**Rank normalisation** (eq. 14): every draw is replaced by the normal score of its average
rank :math:`r` among all :math:`S` pooled draws,
:math:`z = \Phi^{-1}\big((r - 3/8) / (S + 1/4)\big)`. *Bulk* R-hat is split-R-hat of
:math:`z`; *folded* R-hat is split-R-hat of the normal scores of
:math:`\zeta = |\theta - \mathrm{median}(\theta)|` (eq. 15); the recommended *rank*
R-hat is the larger of the two (Section 4.2). Converged chains give values below 1.01.

**ESS** (eqs. 10, 12-13): with :math:`\hat\gamma_{t,m}` the biased autocovariance of
half-chain :math:`m` at lag :math:`t` and :math:`\widehat{\mathrm{var}}^+` as above,

.. math::
    \hat\rho_t = 1 - \frac{W - \frac{1}{M}\sum_m \hat\gamma_{t,m}}
                          {\widehat{\mathrm{var}}^+}, \qquad
    \hat P_k = \hat\rho_{2k} + \hat\rho_{2k+1}, \qquad
    S_{\mathrm{eff}} = \frac{S}{-1 + 2\sum_{k < K} \tilde P_k + \hat\rho_{2K}},

where :math:`K` is the first :math:`k \ge 1` with :math:`\hat P_k \le 0` (Geyer's initial
positive sequence), :math:`\tilde P` is the running minimum of :math:`\hat P` (initial
monotone sequence), :math:`\hat\rho_0 := 1`, the last term averages the sums ending at an
odd and at the next even lag (kept when :math:`\hat P_K \ge 0` or
:math:`\hat\rho_{2K} > 0`), and the denominator is bounded below by :math:`1/\log_{10} S`.
*Bulk*-ESS applies this to :math:`z`; *tail*-ESS is the smaller ESS of the indicators
:math:`I(\theta \le q_{p})` and :math:`I(\theta \le q_{1-p})` of the empirical quantiles
(eq. 16, :math:`p = 0.05`); *mean*-ESS applies it to :math:`\theta` itself.

**Nested R-hat** (Margossian et al. 2024) for :math:`K` superchains of equally many chains
(each started from one point), chains split in half as above:

.. math::
    \widehat{B}_\nu = \operatorname{var}_k(\bar\theta^{(\cdot\cdot k)}), \qquad
    \widehat{W}_\nu = \frac{1}{K}\sum_k \Big(\operatorname{var}_m(\bar\theta^{(\cdot mk)})
    + \frac{1}{M_k}\sum_m s_{mk}^2\Big), \qquad
    \mathfrak{n}\widehat{R} = \sqrt{1 + \widehat{B}_\nu / \widehat{W}_\nu},

with unbiased variances (``ddof=1``) and rank normalisation / folding as for R-hat.

Quantities whose draws contain NaN get NaN, as in ArviZ, so one diverged weight does not
hide the rest; constant quantities get NaN R-hat (zero within-chain variance) and ESS equal
to :math:`S`.

Implementation notes. Ranks need one sort per quantity and folding a second one; that sort
dominates the cost (see :mod:`samplers_as_optim.samples.ranks` for the CPU fast path). The sorted
values are reused for the median and the tail quantiles, so no further sort or selection is
done. Autocovariances are computed lag by lag for the first few lags and only for the
quantities whose Geyer sequence has not terminated yet; the rest (slowly mixing chains)
fall back to one FFT over all lags.

References:
    Vehtari, Gelman, Simpson, Carpenter and Bürkner (2021). Rank-normalization, folding,
    and localization: an improved R-hat for assessing convergence of MCMC. *Bayesian
    Analysis* 16(2), 667-718. Equation numbers as in the accepted manuscript.

    Margossian, Hoffman, Sountsov, Riou-Durand, Vehtari and Gelman (2024). Nested R-hat:
    assessing the convergence of Markov chain Monte Carlo when running many short chains.
    *Bayesian Analysis*.

    Izmailov, Vikram, Hoffman and Wilson (2021). What are Bayesian neural network
    posteriors really like? *ICML*. (R-hat over weights and over predictions.)

Example:
    >>> import torch
    >>> from samplers_as_optim import diagnostics
    >>> g = torch.Generator().manual_seed(0)
    >>> mixed = torch.randn(4, 200, 3, generator=g)        # 4 chains, 200 draws, 3 quantities
    >>> diagnostics.rhat(mixed).shape
    torch.Size([3])
    >>> bool((diagnostics.rhat(mixed) < 1.05).all())
    True
    >>> stuck = mixed + torch.arange(4.0).view(4, 1, 1)    # every chain in its own place
    >>> bool((diagnostics.rhat(stuck) > 1.1).all())
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from .core.validation import (
    check_choice,
    check_chunk_size,
    check_finite,
    check_open_unit_interval,
)
from .samples.ranks import normal_scores, sort_values

__all__ = [
    "Diagnostics",
    "FunctionSpaceDiagnostics",
    "RhatSummary",
    "WeightSpaceDiagnostics",
    "diagnose",
    "ess",
    "function_space",
    "nested_rhat",
    "rhat",
    "summary",
    "weight_space",
]

RhatMethod = Literal["rank", "bulk", "folded", "split"]
EssMethod = Literal["bulk", "tail", "mean"]

_RHAT_METHODS: tuple[str, ...] = ("rank", "bulk", "folded", "split")
_ESS_METHODS: tuple[str, ...] = ("bulk", "tail", "mean")
DEFAULT_THRESHOLDS: tuple[float, ...] = (1.01, 1.05, 1.1)
_DEFAULT_QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)
_MIN_DRAWS = 4  # two draws per half-chain, as ArviZ requires
_CHUNK_ELEMENTS = 2**21  # draws per chunk and thread when chunk_size is None (8-16 MB a buffer)
_LAG_STAGES = (4, 8, 16)  # lags computed directly, for fewer quantities each time, before FFT
_RESOLUTION = float(torch.finfo(torch.float64).resolution)  # ArviZ's "constant" test


# --------------------------------------------------------------------------- results


class Diagnostics(NamedTuple):
    """Rank R-hat, bulk-ESS and tail-ESS of every quantity (see :func:`diagnose`)."""

    rhat: Tensor
    ess_bulk: Tensor
    ess_tail: Tensor


@dataclass(frozen=True)
class RhatSummary:
    """How many quantities have converged, by the usual R-hat thresholds.

    Attributes:
        count: number of R-hat values summarised (NaN excluded).
        num_nan: number of NaN values (constant quantities or NaN draws).
        max: the largest R-hat (``nan`` if ``count`` is 0).
        quantiles: quantile level -> R-hat quantile (linear interpolation).
        fraction_above: threshold -> fraction of the ``count`` values above it.
        count_above: threshold -> number of values above it.
    """

    count: int
    num_nan: int
    max: float
    quantiles: dict[float, float]
    fraction_above: dict[float, float]
    count_above: dict[float, int]

    def __str__(self) -> str:
        quantiles = ", ".join(
            f"q{100 * level:g} {value:.4f}" for level, value in self.quantiles.items()
        )
        above = ", ".join(
            f"> {threshold:g}: {100 * self.fraction_above[threshold]:.2f}% "
            f"({self.count_above[threshold]})"
            for threshold in self.fraction_above
        )
        return (
            f"R-hat over {self.count} quantities ({self.num_nan} NaN): max {self.max:.4f}, "
            f"{quantiles}; {above}"
        )


class WeightSpaceDiagnostics(NamedTuple):
    """Per-parameter R-hat (see :func:`weight_space`).

    Attributes:
        rhat: parameter name -> R-hat tensor of the parameter's shape.
        summary: summary over every scalar weight of every parameter.
        per_parameter: parameter name -> summary over that parameter's weights.
    """

    rhat: dict[str, Tensor]
    summary: RhatSummary
    per_parameter: dict[str, RhatSummary]


class FunctionSpaceDiagnostics(NamedTuple):
    """Per-test-input R-hat of predictions (see :func:`function_space`).

    Attributes:
        rhat: R-hat of every prediction, ``[B, *outputs]``.
        per_input: ``[B]``, the largest R-hat over each input's outputs (NaN ignored).
        summary: summary over ``per_input``: the fraction of test inputs whose
            prediction has not converged.
    """

    rhat: Tensor
    per_input: Tensor
    summary: RhatSummary


# --------------------------------------------------------------------------- validation


def _check_samples(
    samples: object, *, min_chains: int, purpose: str, name: str = "samples"
) -> Tensor:
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


def _superchain_order(superchains: object, chains: int, device: torch.device) -> tuple[Tensor, int]:
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


def _linear_quantile(sorted_values: Tensor, prob: float) -> Tensor:
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


def _compute(
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
    half = draws // 2
    size = 2 * chains * half
    results = {name: torch.empty(count, dtype=dtype, device=device) for name in wanted}
    if chunk_size is None:
        # Each torch kernel is a parallel region: give every thread about _CHUNK_ELEMENTS
        # draws so that synchronisation stays cheap next to the work (up to 4 threads' worth).
        threads = min(torch.get_num_threads(), 4) if device.type == "cpu" else 8
        chunk_size = max(1, _CHUNK_ELEMENTS * threads // (chains * draws))
    step = chunk_size
    need_scores = bool(wanted & {"rhat_bulk", "rhat_folded", "ess_bulk"})
    needs_full_sort = "ess_tail" in wanted and draws % 2 == 1

    def statistic(stats: _ChainStats) -> Tensor:
        if nested is None:
            return _rhat_statistic(stats)
        return _nested_statistic(stats, *nested)

    def chunk(start: int) -> None:  # writes its slice of every result
        stop = min(count, start + step)
        # Copy the chunk's slice first (contiguous runs), then transpose it in memory:
        # twice as fast as gathering [q, chains, draws] straight from the strided input.
        block = flat[:, :, start:stop].contiguous()
        q = stop - start
        split = torch.empty(q, 2, chains, half, dtype=dtype, device=device)
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
        out: dict[str, Tensor] = {}
        ordered = None
        if need_scores:
            scores, ordered = normal_scores(rows, finite=finite)
            scores = scores.view_as(split)
            stats = _chain_stats(scores)
            if "rhat_bulk" in wanted:
                out["rhat_bulk"] = statistic(stats)
            if "ess_bulk" in wanted:
                tied_throughout = ordered[:, 0] == ordered[:, -1]  # the only constant scores
                out["ess_bulk"] = _ess_statistic(scores, stats, tied_throughout)
            del scores, stats
            if "rhat_folded" in wanted:
                median = (ordered[:, size // 2 - 1] + ordered[:, size // 2]) / 2
                # |theta - median| <= max - min, so it is finite when that range is.
                range_finite = finite and bool((ordered[:, -1] - ordered[:, 0]).isfinite().all())
                folded, _ = normal_scores((rows - median.unsqueeze(-1)).abs(), finite=range_finite)
                out["rhat_folded"] = statistic(_chain_stats(folded.view_as(split)))
                del folded
        if wanted & {"rhat_split", "ess_mean"}:
            stats = _chain_stats(split)
            if "rhat_split" in wanted:
                out["rhat_split"] = statistic(stats)
            if "ess_mean" in wanted:
                out["ess_mean"] = _ess_statistic(split, stats)
        if "ess_tail" in wanted:
            if needs_full_sort:
                full = block.permute(2, 0, 1).reshape(q, chains * draws).to(dtype)
                ordered = sort_values(full.masked_fill(has_nan.unsqueeze(-1), 0.0))
            elif ordered is None:
                ordered = sort_values(rows)
            ordered = ordered.to(device)
            tails = []
            for p in (prob, 1.0 - prob):
                indicator = (split <= _linear_quantile(ordered, p).view(q, 1, 1)).to(dtype)
                stats = _chain_stats(indicator)
                fraction = stats.mean.mean(dim=-1)  # an indicator is constant iff 0 or 1
                constant = (fraction == 0) | (fraction == 1)
                tails.append(_ess_statistic(indicator, stats, constant))
            out["ess_tail"] = torch.minimum(*tails)
        for name, value in out.items():
            results[name][start:stop] = value.masked_fill(has_nan, math.nan).to(dtype)

    for start in range(0, count, step):
        chunk(start)
    return {name: value.reshape(trailing) for name, value in results.items()}


def _rhat_names(method: str) -> set[str]:
    return {
        "rank": {"rhat_bulk", "rhat_folded"},
        "bulk": {"rhat_bulk"},
        "folded": {"rhat_folded"},
        "split": {"rhat_split"},
    }[method]


def _combine_rhat(results: Mapping[str, Tensor], method: str) -> Tensor:
    if method == "rank":
        # max() of two NaNs is NaN, and NaN only where both are (constant quantities).
        return torch.fmax(results["rhat_bulk"], results["rhat_folded"])
    return results[_RHAT_NAME[method]]


_RHAT_NAME = {"bulk": "rhat_bulk", "folded": "rhat_folded", "split": "rhat_split"}


# --------------------------------------------------------------------------- public API


def rhat(samples: Tensor, *, method: RhatMethod = "rank", chunk_size: int | None = None) -> Tensor:
    r"""Rank-normalised split R-hat of every quantity (Vehtari et al. 2021).

    .. math::
        \widehat{R}_{\mathrm{rank}} = \max\big(\widehat{R}(z), \widehat{R}(z_\zeta)\big)

    with :math:`z` the normal scores of the pooled draws and :math:`z_\zeta` those of the
    folded draws :math:`|\theta - \mathrm{median}(\theta)|`; see the module docstring for
    :math:`\widehat{R}`. Equal to ``arviz_stats`` ``rhat(method=...)`` (``"bulk"`` is
    ArviZ's ``"z_scale"``). Values above 1.01 indicate chains that have not mixed.

    Args:
        samples: ``[chains, draws, *quantities]``, at least 2 chains and 4 draws. Any real
            dtype (integers are converted to float64); results are float64 for float64
            samples and float32 otherwise.
        method: ``"rank"`` (default; the larger of bulk and folded, Vehtari et al.'s
            recommendation), ``"bulk"`` (rank-normalised split-R-hat), ``"folded"``
            (rank-normalised split-R-hat of folded draws, sensitive to different scales) or
            ``"split"`` (classic split-R-hat of the raw values, no ranks).
        chunk_size: quantities processed at once (bounds memory, roughly 50 bytes per
            draw); None chooses about 2**21 draws per chunk and thread (up to 4 threads).

    Returns:
        R-hat, shape ``quantities``. NaN where a quantity's draws contain NaN or are all
        equal.

    Raises:
        TypeError: ``samples`` is not a real tensor.
        ValueError: fewer than 2 chains, fewer than 4 draws, or an unknown ``method``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import diagnostics
        >>> g = torch.Generator().manual_seed(1)
        >>> x = torch.randn(4, 500, 2, generator=g)
        >>> x[0, :, 1] *= 3.0                      # one chain explores a wider region
        >>> r = diagnostics.rhat(x, method="folded")
        >>> bool(r[0] < 1.01), bool(r[1] > 1.05)
        (True, True)
    """
    return _rhat(samples, method, chunk_size, name="samples")


def _rhat(samples: object, method: str, chunk_size: object, *, name: str) -> Tensor:
    samples = _check_samples(samples, min_chains=2, purpose="R-hat", name=name)
    check_choice("method", method, _RHAT_METHODS)
    results = _compute(samples, _rhat_names(method), chunk_size=check_chunk_size(chunk_size))
    return _combine_rhat(results, method)


def nested_rhat(
    samples: Tensor,
    superchains: int | Sequence[int] | Tensor,
    *,
    method: RhatMethod = "rank",
    chunk_size: int | None = None,
) -> Tensor:
    r"""Nested R-hat for many short chains grouped in superchains (Margossian et al. 2024).

    .. math::
        \mathfrak{n}\widehat{R} = \sqrt{1 + \widehat{B}_\nu / \widehat{W}_\nu}

    (see the module docstring). This is the diagnostic for parallel SGMCMC: run K groups
    of chains, every chain of a group started from the same point (e.g. one deep-ensemble
    member each), and draw few samples per chain; :math:`\mathfrak{n}\widehat{R}` compares
    the superchain means with the spread within superchains, so it can reach 1 before each
    chain is long. Equal to ``arviz_stats`` ``rhat_nested`` for the same ``method``.

    Args:
        samples: ``[chains, draws, *quantities]``, at least 4 draws.
        superchains: the number K >= 2 of superchains, consecutive chains forming one
            (chains must be divisible by K); or one integer id per chain, every id used by
            equally many chains.
        method: as in :func:`rhat`.
        chunk_size: as in :func:`rhat`.

    Returns:
        Nested R-hat, shape ``quantities``.

    Raises:
        TypeError: bad ``samples`` or ``superchains`` types.
        ValueError: fewer than 4 draws, unequal or fewer than 2 superchains, unknown method.

    Example:
        >>> import torch
        >>> from samplers_as_optim import diagnostics
        >>> g = torch.Generator().manual_seed(2)
        >>> x = torch.randn(64, 10, 3, generator=g)   # 64 chains of 10 draws
        >>> bool((diagnostics.nested_rhat(x, 8) < 1.05).all())
        True
        >>> y = x + torch.arange(8.0).repeat_interleave(8).view(64, 1, 1)  # superchains apart
        >>> bool((diagnostics.nested_rhat(y, 8) > 1.1).all())
        True
    """
    samples = _check_samples(samples, min_chains=2, purpose="nested R-hat")
    check_choice("method", method, _RHAT_METHODS)
    nested = _superchain_order(superchains, samples.shape[0], samples.device)
    results = _compute(
        samples, _rhat_names(method), nested=nested, chunk_size=check_chunk_size(chunk_size)
    )
    return _combine_rhat(results, method)


def ess(
    samples: Tensor,
    *,
    method: EssMethod = "bulk",
    prob: float = 0.05,
    chunk_size: int | None = None,
) -> Tensor:
    r"""Effective sample size of every quantity (Vehtari et al. 2021).

    .. math::
        S_{\mathrm{eff}} = \frac{S}{\hat\tau}, \qquad
        \hat\tau = -1 + 2\sum_{k < K}\tilde P_k + \hat\rho_{2K} \ \ge\ 1/\log_{10} S

    over split chains (module docstring). Equal to ``arviz_stats`` ``ess(method=...)``.

    Args:
        samples: ``[chains, draws, *quantities]``, at least 4 draws (one chain is allowed).
        method: ``"bulk"`` (default; ESS of the rank-normalised draws: efficiency for the
            bulk, well defined without finite moments), ``"tail"`` (the smaller ESS of the
            ``prob`` and ``1 - prob`` quantiles: efficiency for intervals) or ``"mean"``
            (ESS of the raw draws: efficiency for the posterior mean).
        prob: tail probability for ``"tail"``, in (0, 1); default 0.05 (the 5% and 95%
            quantiles).
        chunk_size: as in :func:`rhat`.

    Returns:
        ESS, shape ``quantities``; the number of draws for constant quantities, NaN where
        the draws contain NaN.

    Raises:
        TypeError: ``samples`` is not a real tensor.
        ValueError: fewer than 4 draws, unknown ``method`` or ``prob`` outside (0, 1).

    Example:
        >>> import torch
        >>> from samplers_as_optim import diagnostics
        >>> g = torch.Generator().manual_seed(3)
        >>> iid = torch.randn(4, 1000, generator=g)
        >>> sticky = iid.cumsum(dim=1)                   # a random walk mixes badly
        >>> bool(diagnostics.ess(iid) > 3000), bool(diagnostics.ess(sticky) < 100)
        (True, True)
    """
    samples = _check_samples(samples, min_chains=1, purpose="ESS")
    check_choice("method", method, _ESS_METHODS)
    prob = check_open_unit_interval("prob", prob)
    name = f"ess_{method}"
    return _compute(samples, {name}, prob=prob, chunk_size=check_chunk_size(chunk_size))[name]


def diagnose(samples: Tensor, *, prob: float = 0.05, chunk_size: int | None = None) -> Diagnostics:
    """Rank R-hat, bulk-ESS and tail-ESS in one pass that shares the sorts.

    Same values as :func:`rhat` (``method="rank"``), :func:`ess` (``"bulk"``) and
    :func:`ess` (``"tail"``) but cheaper than calling them one by one: the ranks computed
    for R-hat serve bulk-ESS and the tail quantiles. This is what Stan and ArviZ summaries
    report; the recommended targets are R-hat < 1.01 and both ESS > 400 (100 per chain).

    Args:
        samples: ``[chains, draws, *quantities]``, at least 2 chains and 4 draws.
        prob: tail probability for tail-ESS, in (0, 1); default 0.05.
        chunk_size: as in :func:`rhat`.

    Returns:
        :class:`Diagnostics` ``(rhat, ess_bulk, ess_tail)``, each shaped ``quantities``.

    Raises:
        TypeError: ``samples`` is not a real tensor.
        ValueError: fewer than 2 chains or 4 draws, ``prob`` outside (0, 1).

    Example:
        >>> import torch
        >>> from samplers_as_optim import diagnostics
        >>> g = torch.Generator().manual_seed(4)
        >>> result = diagnostics.diagnose(torch.randn(4, 1000, 10, generator=g))
        >>> bool((result.rhat < 1.01).all()), bool((result.ess_bulk > 400).all())
        (True, True)
    """
    samples = _check_samples(samples, min_chains=2, purpose="R-hat")
    prob = check_open_unit_interval("prob", prob)
    wanted = {"rhat_bulk", "rhat_folded", "ess_bulk", "ess_tail"}
    results = _compute(samples, wanted, prob=prob, chunk_size=check_chunk_size(chunk_size))
    return Diagnostics(_combine_rhat(results, "rank"), results["ess_bulk"], results["ess_tail"])


def summary(
    rhat_values: Tensor | Mapping[str, Tensor],
    *,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    quantiles: Sequence[float] = _DEFAULT_QUANTILES,
) -> RhatSummary:
    """Count and fraction of R-hat values above each threshold, with max and quantiles.

    Stan's and Vehtari et al.'s threshold is 1.01; 1.05 and 1.1 are the older, looser
    ones (Izmailov et al. 2021 report the fraction of weights and predictions above 1.1).

    Args:
        rhat_values: a tensor of R-hat values, or a dict of them (e.g.
            :attr:`WeightSpaceDiagnostics.rhat`); all values are pooled.
        thresholds: finite numbers; default (1.01, 1.05, 1.1).
        quantiles: levels in (0, 1); default (0.5, 0.9, 0.99).

    Returns:
        :class:`RhatSummary`. NaN values are counted in ``num_nan`` and left out of the
        rest; +inf counts as above every threshold.

    Raises:
        TypeError: ``rhat_values`` is neither a tensor nor a dict of tensors.
        ValueError: a threshold that is not finite or a quantile level outside (0, 1).

    Example:
        >>> import torch
        >>> from samplers_as_optim import diagnostics
        >>> s = diagnostics.summary(torch.tensor([1.0, 1.002, 1.02, 1.2, float("nan")]))
        >>> s.count, s.num_nan, s.count_above[1.01], s.fraction_above[1.1]
        (4, 1, 2, 0.25)
    """
    if isinstance(rhat_values, Tensor):
        tensors = [rhat_values]
    elif isinstance(rhat_values, Mapping) and all(
        isinstance(value, Tensor) for value in rhat_values.values()
    ):
        tensors = list(rhat_values.values())
    else:
        raise TypeError(
            f"Invalid rhat_values: {type(rhat_values).__name__} (expected a tensor or a dict "
            "of tensors)"
        )
    thresholds = [check_finite("threshold", value) for value in thresholds]
    levels = [check_open_unit_interval("quantile", value) for value in quantiles]
    if tensors:
        values = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    else:
        values = torch.empty(0, dtype=torch.float64)
    is_nan = values.isnan()
    kept = values[~is_nan]
    count = kept.numel()
    if count == 0:
        nan = math.nan
        return RhatSummary(
            0,
            int(is_nan.sum()),
            nan,
            dict.fromkeys(levels, nan),
            dict.fromkeys(thresholds, nan),
            dict.fromkeys(thresholds, 0),
        )
    ordered = sort_values(kept.unsqueeze(0)).to(kept.device)
    count_above = {t: int((kept > t).sum()) for t in thresholds}
    return RhatSummary(
        count=count,
        num_nan=int(is_nan.sum()),
        max=float(ordered[0, -1]),
        # NaN can only come from inf - inf when interpolating towards an infinite R-hat.
        quantiles={
            level: float(_linear_quantile(ordered, level)[0].nan_to_num(nan=math.inf))
            for level in levels
        },
        fraction_above={t: n / count for t, n in count_above.items()},
        count_above=count_above,
    )


def weight_space(
    stacked: Mapping[str, Tensor],
    *,
    method: RhatMethod = "rank",
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    chunk_size: int | None = None,
) -> WeightSpaceDiagnostics:
    """R-hat of every weight of every parameter (weight-space convergence).

    Weight-space R-hat is the strictest check: symmetries (permuted hidden units, sign
    flips) let chains sit in equivalent modes that predict the same, so large weight-space
    R-hat with small :func:`function_space` R-hat is common and not by itself a problem
    (Izmailov et al. 2021).

    Args:
        stacked: parameter name -> tensor ``[chains, draws, *parameter_shape]``, the
            stacked-samples layout with the sample dimension split into chains and draws
            (e.g. ``samples.view(chains, draws, *shape)``).
        method: as in :func:`rhat`.
        thresholds: as in :func:`summary`.
        chunk_size: as in :func:`rhat`.

    Returns:
        :class:`WeightSpaceDiagnostics` with per-parameter R-hat tensors and summaries.

    Raises:
        TypeError: ``stacked`` is not a dict of tensors.
        ValueError: empty dict, tensors that disagree on ``[chains, draws]``, or any error
            of :func:`rhat` (the message names the parameter).

    Example:
        >>> import torch
        >>> from samplers_as_optim import diagnostics
        >>> g = torch.Generator().manual_seed(5)
        >>> stacked = {"weight": torch.randn(4, 200, 3, 2, generator=g),
        ...            "bias": torch.randn(4, 200, 3, generator=g)}
        >>> result = diagnostics.weight_space(stacked)
        >>> result.rhat["weight"].shape, result.summary.count
        (torch.Size([3, 2]), 9)
    """
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
    rhats = {
        name: _rhat(tensor, method, chunk_size, name=f"stacked[{name!r}]")
        for name, tensor in stacked.items()
    }
    return WeightSpaceDiagnostics(
        rhat=rhats,
        summary=summary(rhats, thresholds=thresholds),
        per_parameter={
            name: summary(value, thresholds=thresholds) for name, value in rhats.items()
        },
    )


def function_space(
    predictions: Tensor,
    *,
    method: RhatMethod = "rank",
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    chunk_size: int | None = None,
) -> FunctionSpaceDiagnostics:
    """R-hat of the predictions on every test input (function-space convergence).

    Izmailov et al. (2021) judge HMC on neural networks by R-hat of the predictive
    probabilities over test inputs: what matters for Bayesian model averaging is that the
    chains agree on the function, not on the weights.

    Args:
        predictions: ``[chains, draws, B, *outputs]``, e.g. class probabilities
            ``[chains, draws, B, C]`` (``call_stacked(...).softmax(-1)`` reshaped into
            chains and draws), or regression means ``[chains, draws, B]``.
        method: as in :func:`rhat`.
        thresholds: as in :func:`summary`.
        chunk_size: as in :func:`rhat`.

    Returns:
        :class:`FunctionSpaceDiagnostics`: R-hat ``[B, *outputs]``, the worst R-hat per
        input ``[B]`` and a summary over inputs.

    Raises:
        TypeError: ``predictions`` is not a real tensor.
        ValueError: fewer than 3 dimensions, or any error of :func:`rhat`.

    Example:
        >>> import torch
        >>> from samplers_as_optim import diagnostics
        >>> g = torch.Generator().manual_seed(6)
        >>> probs = torch.randn(4, 300, 5, 3, generator=g).softmax(dim=-1)
        >>> result = diagnostics.function_space(probs)
        >>> result.per_input.shape, result.summary.count_above[1.05]
        (torch.Size([5]), 0)
    """
    if isinstance(predictions, Tensor) and predictions.dim() < 3:
        raise ValueError(
            f"Invalid predictions: shape {tuple(predictions.shape)} (expected "
            "[chains, draws, B, *outputs], at least 3 dimensions)"
        )
    values = _rhat(predictions, method, chunk_size, name="predictions")
    if values.dim() == 1:
        per_input = values
    else:
        flat = values.reshape(values.shape[0], -1)
        worst = torch.where(flat.isnan(), -math.inf, flat).amax(dim=-1)
        per_input = torch.where(flat.isnan().all(dim=-1), math.nan, worst)
    return FunctionSpaceDiagnostics(values, per_input, summary(per_input, thresholds=thresholds))
