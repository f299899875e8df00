r"""A Gaussian over a model's treated weights: what Laplace, the EKF and SWAG share.

Which weights are treated (:func:`select_subset`); one pass over a loader in eval mode;
:class:`_WeightGaussian`, the temperature and the predictive of every such Gaussian
(stacked weight draws, sampled or linearised at the mean: :func:`predict_samples`); and
:class:`_Gaussian`, the :math:`\mathcal N(\mu, T\Lambda^{-1})` of Laplace and the extended
Kalman filter: sampling, log-density and penalty for a diagonal, dense,
Kronecker-factored or low-rank-plus-diagonal precision, and its Gaussian over the outputs
(:meth:`_Gaussian.function_space`), whose GLM predictive in closed form
(``predictive``) is mixed in from :mod:`~samplers_as_optim.gaussian.linearised.glm_predictive`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vmap

from ..core.validation import (
    check_bool,
    check_chunk_size,
    check_positive,
    check_positive_int,
    check_temperature,
)
from ..samples.stacked import call_stacked
from ._data_checks import split_batch
from ._wide_linalg import solve_triangular
from .flat import Treated
from .kfac import KronPrecision
from .likelihoods import Likelihood
from .linearised.function_space import (
    FactoredGaussian,
    FlatPrecision,
    FunctionSpaceGaussian,
    function_space_gaussian,
    output_gaussian,
)
from .linearised.glm_predictive import GLMPredictive

__all__ = [
    "Fitted",
    "Precision",
    "batches_on",
    "evaluating",
    "predict_samples",
    "select_subset",
]

Precision = float | Mapping[str, Tensor] | Tensor
_split_batch = split_batch  # the name the EKF imports
Fitted = dict[str, Tensor] | Tensor | KronPrecision | FlatPrecision


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (examples must not interact), its mode restored afterwards."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def batches_on(loader: Iterable[Any], device: torch.device) -> Iterator[tuple[Tensor, Tensor]]:
    """The ``(inputs, targets)`` pairs of ``loader``, moved to ``device``."""
    for batch in loader:
        inputs, targets = split_batch(batch)
        yield inputs.to(device), targets.to(device)


def select_subset(model: nn.Module, subset: str | Sequence[str] | None) -> Treated:
    """The treated parameters: ``requires_grad`` ones, or the named subset / last layer."""
    if subset is None:
        return Treated.of(model)
    treated_all = Treated.of(model)
    expected = "expected None, 'last_layer' or a list of parameter names"
    named = dict(model.named_parameters())
    if isinstance(subset, str):
        if subset != "last_layer":
            raise ValueError(f"Invalid subset: {subset!r} ({expected})")
        last: list[str] = []
        for prefix, module in model.named_modules():
            owned = [
                f"{prefix}.{local}" if prefix else local
                for local, param in module._parameters.items()
                if param is not None and param.requires_grad
            ]
            if owned:
                last = owned
        names = [name for name in treated_all.names if name in set(last)]
    elif isinstance(subset, Sequence) and all(isinstance(name, str) for name in subset):
        if not subset:
            raise ValueError("Invalid subset: [] (expected at least one parameter name)")
        unknown = [name for name in subset if name not in named]
        if unknown:
            raise ValueError(
                f"Invalid subset: unknown parameter names {unknown} (expected names from "
                f"model.named_parameters(): {list(named)})"
            )
        wanted = set(subset)
        names = [name for name in named if name in wanted]
    else:
        raise TypeError(f"Invalid subset: {subset!r} ({expected})")
    return Treated(tuple(names), tuple(named[name].shape for name in names))


def predict_samples(
    model: nn.Module,
    mean: dict[str, Tensor],
    samples: dict[str, Tensor],
    x: Tensor,
    *,
    linear: bool,
    chunk_size: int | None,
) -> Tensor:
    r"""Outputs for stacked weight draws: :math:`f(x;\theta_s)`, or linearised at ``mean``.

    The shared predictive of every Gaussian here: ``linear=False`` is
    :func:`~samplers_as_optim.samples.stacked.call_stacked`; ``linear=True`` is
    :math:`f(x;\mu) + J_\mu(x)(\theta_s-\mu)`, one ``torch.func.jvp`` per draw.
    """
    if not linear:
        return cast(Tensor, call_stacked(model, samples, x, chunk_size=chunk_size))
    chunk_size = check_chunk_size(chunk_size)
    deltas = {name: samples[name] - mean[name] for name in mean}

    def output(params: dict[str, Tensor]) -> Tensor:
        return cast(Tensor, functional_call(model, params, (x,)))

    def tangent(delta: dict[str, Tensor]) -> Tensor:
        return cast(Tensor, jvp(output, (mean,), (delta,))[1])

    center = output(mean)
    return center + vmap(tangent, chunk_size=chunk_size, randomness="different")(deltas)


class _WeightGaussian:
    """What every Gaussian over a model's treated weights offers: temperature, predictive.

    The predictive is sampled, or linearised at the Gaussian's mean; each Gaussian
    defines how it samples and where its mean is, and which of the two :meth:`predict`
    does by default (:attr:`default_linear`).
    """

    #: What ``predict(x)`` does without ``linear=``: False, sample the weights (SWAG,
    #: whose Gaussian describes the weights an optimizer visits, not a linearised model).
    default_linear: ClassVar[bool] = False
    model: nn.Module
    _temperature: float

    @property
    def temperature(self) -> float:
        """T, which multiplies the covariance; settable (validated) without refitting."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._temperature = check_temperature(value)

    def sample(self, n: int, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """Draw n weight samples in the stacked layout (each Gaussian defines it)."""
        raise NotImplementedError

    def _linearisation_point(self) -> dict[str, Tensor]:
        """The mean the linearised predictive expands around (once there is one)."""
        raise NotImplementedError

    def predict(
        self,
        x: Tensor,
        num_samples: int = 100,
        *,
        linear: bool | None = None,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
    ) -> Tensor:
        r"""Model outputs under ``num_samples`` posterior draws, stacked along dim 0.

        ``linear=True``: :math:`f(x;\mu) + J_{\mu}(x)(\theta_s-\mu)`, the linearised
        network (the GLM predictive of Immer, Korzepa & Bauer 2021, eq. 7; by
        ``torch.func.jvp``, one per draw) at the Gaussian's mean :math:`\mu`
        (:math:`\theta_*` for Laplace and the EKF, the SWA mean for SWAG).
        ``linear=False``: :math:`f(x;\theta_s)`, Monte Carlo in weight space (by
        :func:`~samplers_as_optim.samples.stacked.call_stacked`). Without ``linear``,
        the class's :attr:`default_linear`: the linearised predictive for
        :class:`~samplers_as_optim.Laplace` and the
        :class:`~samplers_as_optim.ExtendedKalmanFilter` (their Gaussians are posteriors
        of the linearised network: the GGN is its curvature, and the EKF linearises at
        every update), weight sampling for :class:`~samplers_as_optim.SWAG`. Weight
        sampling puts draws through the nonlinear network with a covariance fitted for
        the linearised one, and underfits (Immer et al. 2021, §3; Daxberger et al.
        2021, §2); the closed forms of the same linearised predictive are
        :meth:`Laplace.predictive <samplers_as_optim.Laplace.predictive>` (and the EKF's).

        The result has the layout of a ``ParallelEnsemble``'s output, so the
        :mod:`~samplers_as_optim.predictive` helpers apply:
        ``predictive.classification(la.predict(x))`` for a classifier's Bayesian model
        average and its uncertainty split, and ``predictive.regression(la.predict(x),
        la.noise_std**2)`` for regression. The model runs in its current mode, with the
        parameters outside the Gaussian and the buffers at their current values (for
        SWAG, update BatchNorm statistics at the SWA mean first, as its paper does).

        Args:
            x: a batch of inputs on the parameters' device.
            num_samples: S, the number of weight draws (default: 100; an integer >= 1).
            linear: linearise the network around the mean (True) or sample the weights
                (False); None (default) takes the class's :attr:`default_linear`: True
                for Laplace and the EKF, False for SWAG.
            generator: ``torch.Generator`` for the draws (default: None, global RNG).
            chunk_size: evaluate at most this many samples at once (default: None, all).

        Returns:
            Outputs of shape ``(S, *model(x).shape)``.
        """
        if linear is None:
            linear = self.default_linear
        if not isinstance(linear, bool):
            raise TypeError(f"Invalid linear: {linear!r} (expected True or False)")
        num_samples = check_positive_int("num_samples", num_samples)
        samples = self.sample(num_samples, generator=generator)
        mean = self._linearisation_point()
        return predict_samples(self.model, mean, samples, x, linear=linear, chunk_size=chunk_size)


class _Gaussian(_WeightGaussian, GLMPredictive):
    r"""A Gaussian :math:`\mathcal N(\mu, T\Lambda^{-1})` over a model's treated parameters.

    The shared half of :class:`Laplace` and the extended Kalman filter: sampling,
    log-density, penalty, the sampled and linearised predictive (linearised by default:
    both Gaussians are posteriors of the network linearised at their mean) and its
    closed forms (:meth:`function_space`; :meth:`predictive`, mixed in from
    ``glm_predictive``), for a diagonal (dict), dense (P x P with its Cholesky factor),
    Kronecker-factored (:class:`~samplers_as_optim.gaussian.kfac.KronPrecision`) or
    low-rank-plus-diagonal (a
    :class:`~samplers_as_optim.gaussian.linearised.function_space.FlatPrecision`) precision.
    """

    #: ``predict(x)`` linearises by default (the GLM predictive; Immer et al. 2021).
    default_linear: ClassVar[bool] = True
    model: nn.Module
    likelihood: Likelihood
    noise_std: Any
    treated: Treated
    structure: str
    prior_precision: float | dict[str, Tensor] | Tensor
    _mean: dict[str, Tensor] | None
    _precision: Fitted | None
    _cholesky: Tensor | None
    _not_fitted = "Laplace is not fitted yet: call fit(loader) first"

    def _fitted(self) -> tuple[dict[str, Tensor], Any]:
        if self._mean is None:
            raise RuntimeError(self._not_fitted)
        return self._mean, self._precision

    # ------------------------------------------------------------------ setup helpers
    def _reference(self) -> Tensor:
        params = dict(self.model.named_parameters())
        return params[self.treated.names[0]]

    def _check_prior(self, prior: Any) -> float | dict[str, Tensor] | Tensor:
        ref = self._reference()
        if isinstance(prior, Mapping):
            missing = [name for name in self.treated.names if name not in prior]
            if missing:
                raise ValueError(
                    f"Invalid prior_precision: dict without {missing} (expected a positive "
                    "precision tensor for every treated parameter)"
                )
            checked = {}
            for name, shape in zip(self.treated.names, self.treated.shapes, strict=True):
                value = torch.as_tensor(prior[name], dtype=ref.dtype, device=ref.device)
                if value.shape != shape or not bool(torch.all(value > 0) & value.isfinite().all()):
                    raise ValueError(
                        f"Invalid prior_precision: entry {name!r} of shape "
                        f"{tuple(value.shape)} (expected finite values > 0 of shape "
                        f"{tuple(shape)})"
                    )
                checked[name] = value.detach().clone()
            return checked
        if isinstance(prior, Tensor) and prior.numel() > 1:
            size = self.treated.numel
            if self.structure != "dense" or prior.shape != (size, size):
                raise ValueError(
                    f"Invalid prior_precision: tensor of shape {tuple(prior.shape)} (expected "
                    f"a number, a dict of per-parameter precisions, or with "
                    f"structure='dense' a ({size}, {size}) positive-definite matrix)"
                )
            matrix = prior.detach().to(dtype=ref.dtype, device=ref.device).clone()
            if not bool(torch.allclose(matrix, matrix.T)) or (
                torch.linalg.cholesky_ex(matrix).info != 0
            ):
                raise ValueError(
                    f"Invalid prior_precision: a ({size}, {size}) matrix that is not "
                    "symmetric positive definite (expected a precision matrix)"
                )
            return matrix
        return check_positive("prior_precision", prior)

    def _prior_flat(self) -> Tensor:
        """The prior precision as a flat diagonal (P,) or a dense (P, P) matrix."""
        ref = self._reference()
        prior = self.prior_precision
        if isinstance(prior, Tensor):
            return prior
        if isinstance(prior, dict):
            diag = self.treated.flatten(prior)
        else:
            diag = torch.full((self.treated.numel,), prior, dtype=ref.dtype, device=ref.device)
        return diag if self.structure == "diag" else torch.diag(diag)

    @property
    def mean(self) -> dict[str, Tensor]:
        r""":math:`\theta_*`: name -> the treated parameter's value when :meth:`fit` ran."""
        return dict(self._fitted()[0])

    @property
    def precision(self) -> Fitted:
        r""":math:`\Lambda` at temperature 1 (a dict, a matrix, a KronPrecision, ...).

        A dict of diagonals (``"diag"``), (P, P) (``"dense"``), a
        :class:`~samplers_as_optim.gaussian.kfac.KronPrecision` (``"kron"``) or a
        :class:`~samplers_as_optim.gaussian.laplace._lowrank.LowRankPrecision`
        (``"lowrank"``: its ``diagonal``, ``eigenvectors``, ``eigenvalues``, ``rank``).
        Pass a diagonal or dense one as the next task's ``prior_precision`` (continual
        learning).
        """
        precision = self._fitted()[1]
        return dict(precision) if isinstance(precision, dict) else precision

    @property
    def covariance(self) -> dict[str, Tensor] | Tensor:
        r""":math:`T\Lambda^{-1}`: a dict of variances, or the (P, P) matrix (``"dense"``).

        For ``"kron"`` and ``"lowrank"``, a dict of its marginal variances (its diagonal,
        exact through the eigendecompositions or Woodbury; the matrix is never formed).
        """
        precision = self._fitted()[1]
        if isinstance(precision, FlatPrecision):
            return self.treated.unflatten(self.temperature * precision.variances())
        if isinstance(precision, dict):
            return {name: self.temperature / value for name, value in precision.items()}
        if isinstance(precision, KronPrecision):
            return {name: self.temperature * value for name, value in precision.variances().items()}
        assert self._cholesky is not None
        return self.temperature * torch.cholesky_inverse(self._cholesky).to(self._reference().dtype)

    def sample(self, n: int, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        r"""Draw n weight samples :math:`\theta_s = \theta_* + \sqrt{T}\,\Lambda^{-1/2}\xi_s`.

        With :math:`\Lambda = LL^\top` (Cholesky) the dense square root is
        :math:`L^{-\top}`; for ``"diag"`` it is :math:`1/\sqrt{\Lambda_{jj}}`; for
        ``"kron"`` it is :math:`(Q_G\otimes Q_A)\,\mathrm{diag}(D)^{-1/2}` per layer (see
        :mod:`samplers_as_optim.gaussian.kfac`); for ``"lowrank"``
        :math:`A^{-1/2}(I + BB^\top)^{-1/2}` (exact, see
        :mod:`samplers_as_optim.gaussian.laplace._lowrank`).

        Args:
            n: number of samples (an integer >= 1).
            generator: a ``torch.Generator`` on the parameters' device for reproducible
                draws (default: None, torch's global RNG).

        Returns:
            The stacked layout: name -> tensor ``(n, *shape)`` for every treated
            parameter (see :mod:`samplers_as_optim.samples.stacked`).
        """
        n = check_positive_int("n", n)
        mean, precision = self._fitted()
        flat_mean = self.treated.flatten(mean)
        noise = torch.randn(
            n,
            self.treated.numel,
            generator=generator,
            dtype=flat_mean.dtype,
            device=flat_mean.device,
        )
        scale = math.sqrt(self.temperature)
        if isinstance(precision, FlatPrecision):
            step = scale * precision.inverse_sqrt(noise)
        elif isinstance(precision, dict):
            step = noise * (scale * self.treated.flatten(precision).rsqrt())
        elif isinstance(precision, KronPrecision):
            step = scale * self.treated.flatten(
                precision.inverse_sqrt(self.treated.unflatten(noise)), batch_dims=1
            )
        else:
            assert self._cholesky is not None
            step = scale * solve_triangular(self._cholesky.T, noise.T, upper=True).T
        return self.treated.unflatten(flat_mean + step)

    def log_prob(self, params: Mapping[str, Tensor] | nn.Module) -> Tensor:
        r"""Log-density of :math:`q = \mathcal N(\theta_*, T\Lambda^{-1})` at ``params``.

        .. math::

            \log q(\theta) = -\tfrac{1}{2T}(\theta-\theta_*)^\top\Lambda(\theta-\theta_*)
            + \tfrac12\log\det(\Lambda/T) - \tfrac P2\log 2\pi.

        Differentiable in ``params``. Continual learning (the posterior as the next
        task's prior; Kirkpatrick et al. 2017, Huszár 2018): train the next task on
        ``mean_nll + la.penalty(model) / num_data_next`` (:meth:`penalty`, the same up to a
        constant) and fit its Laplace with
        ``prior_precision=la.precision``; at T = 1 this is the Bayesian online update. At
        T != 1, the next task's prior is the temperature-1 Gaussian, whose negative
        log-density is ``-T * la.log_prob(model)`` up to a constant.

        Args:
            params: a dict with every treated name (each tensor shaped like the
                parameter, or with one leading sample dimension as :meth:`sample`
                returns) or a module with the same parameter names (e.g. the model).

        Returns:
            A scalar, or one value per sample for stacked input.
        """
        if self.temperature == 0.0:
            raise ValueError(
                "Invalid temperature: 0.0 (expected > 0 for log_prob: at temperature 0 the "
                "posterior is a point mass)"
            )
        quad, logdet = self._quadratic(params)
        size, temperature = self.treated.numel, self.temperature
        return (
            -0.5 * quad / temperature
            + 0.5 * (logdet - size * math.log(temperature))
            - 0.5 * size * math.log(2 * math.pi)
        )

    def penalty(self, params: Mapping[str, Tensor] | nn.Module) -> Tensor:
        r"""The next task's prior term: the quadratic form of the precision at ``params``.

        .. math::

            \text{penalty}(\theta) = \tfrac12(\theta-\theta_*)^\top\Lambda(\theta-\theta_*).

        The negative log-density of the temperature-1 posterior without its constant
        (so a printed training loss is not offset): train the next task on
        ``mean_nll + la.penalty(model) / num_data_next`` and fit its Laplace with
        ``prior_precision=la.precision``. Independent of ``temperature``; differentiable
        in ``params``; the same inputs as :meth:`log_prob`.

        Example:
            >>> import torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> from samplers_as_optim import Laplace
            >>> model = torch.nn.Linear(2, 1)
            >>> x, y = torch.randn(32, 2), torch.randn(32, 1)
            >>> la = Laplace(model, num_data=32, likelihood="regression", noise_std=1.0)
            >>> la = la.fit(DataLoader(TensorDataset(x, y), batch_size=8))
            >>> la.penalty(model).item()  # zero at the mean
            0.0
        """
        return 0.5 * self._quadratic(params)[0]

    def _quadratic(self, params: Mapping[str, Tensor] | nn.Module) -> tuple[Tensor, Tensor]:
        """``(theta - mean)^T Lambda (theta - mean)`` (per sample) and ``log det Lambda``."""
        mean, precision = self._fitted()
        if isinstance(params, nn.Module):
            params = dict(params.named_parameters())
        missing = [name for name in self.treated.names if name not in params]
        if missing:
            raise KeyError(f"Invalid params: missing {missing} (expected every treated name)")
        first, shape = self.treated.names[0], self.treated.shapes[0]
        batch_dims = params[first].dim() - len(shape)
        if batch_dims not in (0, 1):
            raise ValueError(
                f"Invalid params: {first!r} has shape {tuple(params[first].shape)} (expected "
                f"{tuple(shape)}, optionally with one leading sample dimension)"
            )
        delta = self.treated.flatten(params, batch_dims) - self.treated.flatten(mean)
        if isinstance(precision, KronPrecision):
            quad = precision.quadratic(self.treated.unflatten(delta), batch_dims)
            return quad, precision.logdet()
        if isinstance(precision, FlatPrecision):
            return precision.quadratic(delta), precision.logdet()
        if isinstance(precision, dict):
            diag = self.treated.flatten(precision)
            return (delta.square() * diag).sum(-1), diag.log().sum()
        assert self._cholesky is not None
        quad = (delta.to(self._cholesky.dtype) @ self._cholesky).square().sum(-1)
        return quad.to(delta.dtype), 2.0 * self._cholesky.diagonal().log().sum().to(delta.dtype)

    def _linearisation_point(self) -> dict[str, Tensor]:
        return self._fitted()[0]

    # ------------------------------------------------------------------ GLM predictive
    def function_space(
        self,
        x: Tensor,
        *,
        chunk_size: int | None = None,
        per_position: bool = False,
        diagonal: bool = False,
    ) -> FunctionSpaceGaussian:
        r"""The linearised network's Gaussian over each input's outputs, exactly.

        .. math::

            f(x) \sim \mathcal N\big(f(x;\theta_*),\; T\,J(x)\,\Lambda^{-1}J(x)^\top\big),
            \qquad J(x) = \partial f(x;\theta)/\partial\theta\,\big|_{\theta_*},

        the distribution of :meth:`predict`'s ``linear=True`` draws, without sampling
        (Immer, Korzepa & Bauer 2021, eq. 7). J covers the treated parameters only (a
        last-layer Laplace differentiates the last layer only); :math:`\Lambda^{-1}` is
        applied through the fitted structure (diagonal, Cholesky factor, the KFAC
        eigendecompositions, or the low-rank square root), see
        :mod:`~samplers_as_optim.gaussian.linearised.function_space`.
        The model runs in eval mode (its mode is restored), one input at a time inside
        ``vmap``; parameters outside the Gaussian and buffers at their current values.

        Cost, with O outputs per input and P treated scalars: O vectorised reverse
        passes per input; memory :math:`3\cdot C\cdot O\cdot P` numbers for a chunk
        of C inputs (C chosen to stay under 256 MiB unless ``chunk_size`` is given);
        time :math:`O(B\cdot O^2 P)` for the products (:math:`O(B\cdot OP)` with
        ``diagonal``), plus :math:`O(B\cdot O P^2)` for ``"dense"``
        (:math:`O(B\cdot O Pk)` for ``"lowrank"``). Refused when one input's Jacobian
        cannot fit in memory. A last layer (the treated weights one ``nn.Linear``'s,
        its output the model's) with ``"diag"``, ``"kron"`` or ``"lowrank"`` forms no
        Jacobian: :math:`J = I_C\otimes\tilde\phi(x)^\top`, one forward, costs per
        input in :mod:`~samplers_as_optim.gaussian.linearised._last_layer` (the joint
        covariance of outputs with positions still takes the Jacobian).

        Args:
            x: a batch of inputs on the parameters' device (the batch first).
            chunk_size: inputs per Jacobian chunk (default: None, automatic; an integer
                >= 1). The result does not depend on it.
            per_position: for outputs ``(B, *positions, K)`` (a language model's
                ``(batch, sequence, vocabulary)``), only each position's K x K block of the
                covariance (default: False, the joint one); what :meth:`predictive` uses.
                No effect on ``(B, K)`` outputs.
            diagonal: only the marginal variances :math:`\mathrm{diag}\,\Sigma_f`,
                shaped like ``mean`` (default: False), what the probit link and
                regression read; cheaper in time and memory.

        Returns:
            :class:`~samplers_as_optim.gaussian.linearised.function_space.FunctionSpaceGaussian`
            ``(mean, covariance)``: ``mean`` ``(B, *out)`` the network at
            :math:`\theta_*`, ``covariance`` ``(B, O, O)`` with O the outputs per input
            (flattened, row-major), or with ``per_position`` ``(B, *positions, K, K)``,
            or with ``diagonal`` ``(B, *out)``; detached.

        Raises:
            RuntimeError: not fitted yet.
            ValueError: a bad ``chunk_size``, outputs without the batch first, or one
                input's Jacobian too large for the device's free memory.
            TypeError: ``per_position`` or ``diagonal`` is not a bool.
        """
        chunk_size = check_chunk_size(chunk_size)
        per_position = check_bool("per_position", per_position)
        diagonal = check_bool("diagonal", diagonal)
        fitted = self._function_space_fit()
        with evaluating(self.model):
            return function_space_gaussian(*fitted, x, chunk_size, per_position, diagonal)

    def _output_gaussian(
        self, x: Tensor, chunk_size: int | None
    ) -> FunctionSpaceGaussian | FactoredGaussian:
        """:meth:`function_space` per position, or a last layer's factored Gaussian."""
        chunk_size = check_chunk_size(chunk_size)
        fitted = self._function_space_fit()
        with evaluating(self.model):
            return output_gaussian(*fitted, x, chunk_size)

    def _function_space_fit(
        self,
    ) -> tuple[nn.Module, Treated, dict[str, Tensor], Fitted, Tensor | None, float]:
        """The fit as the function-space routines take it: their first six arguments.

        ``(model, treated, mean, precision, cholesky, temperature)`` for
        :func:`~.linearised.function_space.function_space_gaussian` and
        :func:`~.linearised.function_space.output_gaussian`; RuntimeError if not fitted.
        """
        mean, precision = self._fitted()
        return self.model, self.treated, mean, precision, self._cholesky, self.temperature
