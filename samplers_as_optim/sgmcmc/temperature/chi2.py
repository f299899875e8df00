r"""The quantiles of :math:`\chi^2_d`: the kinetic temperature's band.

Read by ``temperature/estimates``.
"""

from __future__ import annotations

import math
import statistics
from functools import lru_cache

import torch

from ...core.validation import refuse

__all__ = ["chi2_quantile"]


def chi2_quantile(probability: float, dof: int) -> float:
    r"""The quantile of :math:`\chi^2_{\text{dof}}` at ``probability``.

    Wilson & Hilferty's cube-root approximation, refined by safeguarded Newton steps on
    the regularised incomplete gamma function :math:`P(\text{dof}/2, x/2)`
    (``torch.special.gammainc``, float64 on the CPU) to a relative 1e-10. Cached: a
    monitor's bands, whose ``dof`` is its fixed subset's size, cost nothing after the
    first window.
    """
    if not 0.0 < probability < 1.0:
        refuse("probability", probability, "a number in (0, 1)", "")
    if dof < 1:
        refuse("dof", dof, "an integer >= 1", "")
    return _chi2_quantile(float(probability), dof)


@lru_cache(maxsize=1024)
def _chi2_quantile(probability: float, dof: int) -> float:
    k = dof / 2.0
    z = statistics.NormalDist().inv_cdf(probability)
    c = 2.0 / (9.0 * dof)
    x = dof * max(1.0 - c + z * math.sqrt(c), 1e-3) ** 3
    low, high = 0.0, math.inf
    log_norm = k * math.log(2.0) + math.lgamma(k)
    for _ in range(100):
        cdf = float(
            torch.special.gammainc(
                torch.tensor(k, dtype=torch.float64), torch.tensor(x / 2.0, dtype=torch.float64)
            )
        )
        if cdf < probability:
            low = x
        else:
            high = x
        density = math.exp((k - 1.0) * math.log(x) - x / 2.0 - log_norm)
        step = (cdf - probability) / density if density > 0 else math.inf
        candidate = x - step
        if not low < candidate < high:  # Newton left the bracket: bisect
            candidate = (low + high) / 2.0 if math.isfinite(high) else 2.0 * x
        if abs(candidate - x) <= 1e-12 * x:
            return candidate
        x = candidate
    return x
