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
from .samples.ranks import sort_values
from .samples.rhat_ess import (
    RHAT_METHODS,
    check_predictions,
    check_samples,
    check_stacked,
    combine_rhat,
    compute,
    linear_quantile,
    rhat_names,
    rhat_of,
    rhat_tensors,
    superchain_order,
    worst_per_input,
)
from .sgmcmc.temperature.estimates import ChainTemperatureReport
from .sgmcmc.temperature.monitor import ChainTemperatureWarning, TemperatureMonitor

__all__ = [
    "ChainTemperatureReport",
    "ChainTemperatureWarning",
    "Diagnostics",
    "FunctionSpaceDiagnostics",
    "RhatSummary",
    "TemperatureMonitor",
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

_ESS_METHODS: tuple[str, ...] = ("bulk", "tail", "mean")
DEFAULT_THRESHOLDS: tuple[float, ...] = (1.01, 1.05, 1.1)
_DEFAULT_QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)


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
    return rhat_of(samples, method, chunk_size, name="samples")


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
    samples = check_samples(samples, min_chains=2, purpose="nested R-hat")
    check_choice("method", method, RHAT_METHODS)
    nested = superchain_order(superchains, samples.shape[0], samples.device)
    results = compute(
        samples, rhat_names(method), nested=nested, chunk_size=check_chunk_size(chunk_size)
    )
    return combine_rhat(results, method)


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
    samples = check_samples(samples, min_chains=1, purpose="ESS")
    check_choice("method", method, _ESS_METHODS)
    prob = check_open_unit_interval("prob", prob)
    name = f"ess_{method}"
    return compute(samples, {name}, prob=prob, chunk_size=check_chunk_size(chunk_size))[name]


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
    samples = check_samples(samples, min_chains=2, purpose="R-hat")
    prob = check_open_unit_interval("prob", prob)
    wanted = {"rhat_bulk", "rhat_folded", "ess_bulk", "ess_tail"}
    results = compute(samples, wanted, prob=prob, chunk_size=check_chunk_size(chunk_size))
    return Diagnostics(combine_rhat(results, "rank"), results["ess_bulk"], results["ess_tail"])


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
    tensors = rhat_tensors(rhat_values)
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
            level: float(linear_quantile(ordered, level)[0].nan_to_num(nan=math.inf))
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
    check_stacked(stacked)
    rhats = {
        name: rhat_of(tensor, method, chunk_size, name=f"stacked[{name!r}]")
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
    check_predictions(predictions)
    values = rhat_of(predictions, method, chunk_size, name="predictions")
    per_input = worst_per_input(values)
    return FunctionSpaceDiagnostics(values, per_input, summary(per_input, thresholds=thresholds))
