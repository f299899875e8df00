r"""Laplace approximation around a trained model, in the units of docs/design.md.

The user trained by minimising the mean minibatch loss :math:`L(\theta) = \frac1B
\sum_{i\in\text{batch}} \ell_i(\theta) - \log p(\theta) / N`, with :math:`\ell_i =
-\log p(y_i \mid x_i, \theta)`. Its N multiple is the negative log posterior
:math:`U(\theta) = \sum_{i=1}^N \ell_i(\theta) - \log p(\theta)`, and the tempered target is
:math:`p_T(\theta\mid D) \propto \exp(-U(\theta)/T)`. A second-order expansion at the mode
:math:`\theta_*` (the trained weights), with the per-example Hessian
:math:`\nabla^2\ell_i` replaced by a positive semi-definite curvature :math:`C_i`, gives

.. math::

    q(\theta) = \mathcal N\big(\theta_*,\; T\,\Lambda^{-1}\big), \qquad
    \Lambda = \Lambda_0 + \frac{N}{n} \sum_{i=1}^{n} C_i(\theta_*),

where the sum runs over the n examples :meth:`Laplace.fit` sees in its one pass (n = N
when the loader covers the training set; otherwise the mean curvature over the n
examples is scaled to N, i.e. :math:`\Lambda = \Lambda_0 + N\,\nabla^2_{\text{curv}} L`,
the curvature of the mean loss times N). :math:`\Lambda_0` is the prior precision: a
prior :math:`\mathcal N(0, \sigma^2)` on every weight is ``prior_precision`` =
:math:`1/\sigma^2` = ``num_data * weight_decay`` for the ``weight_decay`` that SGD (or a
sampler) would use for it. ``temperature`` multiplies the covariance; ``precision``
reports :math:`\Lambda`, the temperature-1 precision, which is what the next task's prior
needs (see :meth:`Laplace.log_prob`).

The curvatures (Kunstner et al. 2019; Martens 2020), with :math:`J_i = \partial
f(x_i;\theta)/\partial\theta` and :math:`H_i = \nabla_f^2 \ell_i`:

* ``"ggn"``: :math:`C_i = J_i^\top H_i J_i`, the generalised Gauss-Newton, equal to the
  Fisher for the exponential-family likelihoods here (posteriors paper, App. A.1, eq. 7);
* ``"ef"``: :math:`C_i = \nabla\ell_i \nabla\ell_i^\top`, the empirical Fisher.

``"diag"`` keeps :math:`\mathrm{diag}(\Lambda)`; ``"dense"`` keeps all of it (refused, with
the size, when it cannot fit in memory). Neither forms the Jacobian. Both curvatures are
:math:`\sum_{i,k} g_{ik} g_{ik}^\top` with :math:`g_{ik} = J_i^\top v_{ik}` (K = 1 column
:math:`v_i = \nabla_f\ell_i` for the EF; K columns with :math:`V_iV_i^\top = H_i` for the
GGN, e.g. :math:`\sqrt{p_c}(e_c - p)` for softmax). For an ``nn.Linear`` layer with inputs
A and output gradients :math:`G_k` the diagonal is :math:`(\sum_k G_k\circ G_k)^\top
(A\circ A)`: one forward and one backward vmapped over the K columns per batch, no
per-example gradient formed. ``nn.Conv2d`` forms per-example gradients of that layer
only, a chunk of examples at a time; other modules (and dense) use chunked
``vmap(vjp)`` per example. See ``samplers_as_optim/_curvature.py``.

``"kron"`` keeps a Kronecker factor pair per ``nn.Linear``/``nn.Conv2d`` layer (KFAC;
Martens & Grosse 2015, Ritter et al. 2018), the bias inside the factor, with the damped
inverse, log-determinant and square root exact through the factors'
eigendecompositions (:mod:`samplers_as_optim.gaussian.kfac`); other treated parameters get a
diagonal. ``subset="last_layer"`` (or a list of parameter names) restricts the Gaussian
to those weights and keeps the others at the MAP (Kristiadi, Hein & Hennig 2020;
Daxberger et al. 2021, §3.1): samples, log-densities and both predictives then cover the
subset only.

Predictions (:meth:`Laplace.predict`) are Monte Carlo over weights,
:math:`f(x; \theta_s)`, or linearised (the GLM predictive of Immer, Korzepa & Bauer 2021):
:math:`f_\text{lin}(x;\theta_s) = f(x;\theta_*) + J_{\theta_*}(x)(\theta_s - \theta_*)`, one
forward-mode ``torch.func.jvp`` per sample, :math:`\theta_s \sim q`.

References:
    MacKay (1992), A practical Bayesian framework for backpropagation networks.
    Daxberger et al. (2021), Laplace Redux — effortless Bayesian deep learning, §2.
    Kunstner, Hennig & Balles (2019), Limitations of the empirical Fisher approximation.
    Martens (2020), New insights and perspectives on the natural gradient method, §9.
    Immer, Korzepa & Bauer (2021), Improving predictions of Bayesian neural nets via
    local linearization, eq. 7.
    Duffield et al. (2024), Scalable Bayesian learning with posteriors, §2 and App. A.1.
    Martens & Grosse (2015), Optimizing neural networks with Kronecker-factored
    approximate curvature. Ritter, Botev & Barber (2018), A scalable Laplace
    approximation for neural networks.
    Kristiadi, Hein & Hennig (2020), Being Bayesian, even just a bit, fixes overconfidence
    in ReLU networks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vmap

from ..core.validation import (
    check_choice,
    check_chunk_size,
    check_num_data,
    check_positive,
    check_positive_int,
    check_temperature,
)
from ..samples.stacked import call_stacked
from ._memory import check_dense_fits
from ._per_example_curvature import DenseSum, check_finite_curvature, diag_curvature
from .flat import Treated
from .kfac import KronPrecision, KronSums, build_precision, kron_curvature, kron_layers
from .likelihoods import make_likelihood

__all__ = ["Laplace"]

Precision = float | Mapping[str, Tensor] | Tensor
Fitted = dict[str, Tensor] | Tensor | KronPrecision


def _split_batch(batch: Any) -> tuple[Tensor, Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"Invalid batch: {type(batch).__name__} (expected a pair (inputs, targets), as a "
        "DataLoader over a TensorDataset yields)"
    )


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


class _Gaussian:
    r"""A Gaussian :math:`\mathcal N(\mu, T\Lambda^{-1})` over a model's treated parameters.

    The shared half of :class:`Laplace` and the extended Kalman filter: sampling,
    log-density, penalty and the sampled and linearised predictive, for a diagonal
    (dict), dense (P x P with its Cholesky factor) or Kronecker-factored
    (:class:`~samplers_as_optim.gaussian.kfac.KronPrecision`) precision.
    """

    model: nn.Module
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
    def temperature(self) -> float:
        """T, which multiplies the covariance; settable (validated) without refitting."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._temperature = check_temperature(value)

    @property
    def mean(self) -> dict[str, Tensor]:
        r""":math:`\theta_*`: name -> the treated parameter's value when :meth:`fit` ran."""
        return dict(self._fitted()[0])

    @property
    def precision(self) -> Fitted:
        r""":math:`\Lambda` at temperature 1 (a dict, a matrix or a KronPrecision).

        A dict of diagonals (``"diag"``), (P, P) (``"dense"``) or a
        :class:`~samplers_as_optim.gaussian.kfac.KronPrecision` (``"kron"``).
        Pass a diagonal or dense one as the next task's ``prior_precision`` (continual
        learning).
        """
        precision = self._fitted()[1]
        return dict(precision) if isinstance(precision, dict) else precision

    @property
    def covariance(self) -> dict[str, Tensor] | Tensor:
        r""":math:`T\Lambda^{-1}`: a dict of variances, or the (P, P) matrix (``"dense"``).

        For ``"kron"``, a dict of its marginal variances (its diagonal, exact through the
        eigendecomposition; the matrix itself is never formed).
        """
        precision = self._fitted()[1]
        if isinstance(precision, dict):
            return {name: self.temperature / value for name, value in precision.items()}
        if isinstance(precision, KronPrecision):
            return {name: self.temperature * value for name, value in precision.variances().items()}
        assert self._cholesky is not None
        return self.temperature * torch.cholesky_inverse(self._cholesky)

    def sample(self, n: int, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        r"""Draw n weight samples :math:`\theta_s = \theta_* + \sqrt{T}\,\Lambda^{-1/2}\xi_s`.

        With :math:`\Lambda = LL^\top` (Cholesky) the dense square root is
        :math:`L^{-\top}`; for ``"diag"`` it is :math:`1/\sqrt{\Lambda_{jj}}`; for
        ``"kron"`` it is :math:`(Q_G\otimes Q_A)\,\mathrm{diag}(D)^{-1/2}` per layer (see
        :mod:`samplers_as_optim.gaussian.kfac`).

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
        if isinstance(precision, dict):
            step = noise * (scale * self.treated.flatten(precision).rsqrt())
        elif isinstance(precision, KronPrecision):
            step = scale * self.treated.flatten(
                precision.inverse_sqrt(self.treated.unflatten(noise)), batch_dims=1
            )
        else:
            assert self._cholesky is not None
            step = scale * torch.linalg.solve_triangular(self._cholesky.T, noise.T, upper=True).T
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
        if isinstance(precision, dict):
            diag = self.treated.flatten(precision)
            return (delta.square() * diag).sum(-1), diag.log().sum()
        assert self._cholesky is not None
        quad = (delta @ self._cholesky).square().sum(-1)
        return quad, 2.0 * self._cholesky.diagonal().log().sum()

    # ------------------------------------------------------------------ predictions
    def predict(
        self,
        x: Tensor,
        num_samples: int = 100,
        *,
        linear: bool = False,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
    ) -> Tensor:
        r"""Model outputs under ``num_samples`` posterior draws, stacked along dim 0.

        ``linear=False``: :math:`f(x;\theta_s)` (Monte Carlo in weight space, by
        :func:`~samplers_as_optim.samples.stacked.call_stacked`). ``linear=True``:
        :math:`f(x;\theta_*) + J_{\theta_*}(x)(\theta_s-\theta_*)` (the linearised / GLM
        predictive, by ``torch.func.jvp``). The result has the layout of a
        ``ParallelEnsemble``'s output, so the :mod:`~samplers_as_optim.predictive`
        helpers apply: ``predictive.classification(la.predict(x))`` for a classifier's
        Bayesian model average and its uncertainty split, and
        ``predictive.regression(la.predict(x), la.noise_std**2)`` for regression. The
        model runs in its current mode.

        Args:
            x: a batch of inputs on the parameters' device.
            num_samples: S, the number of weight draws (default: 100; an integer >= 1).
            linear: linearise the network around :math:`\theta_*` (default: False).
            generator: ``torch.Generator`` for the draws (default: None, global RNG).
            chunk_size: evaluate at most this many samples at once (default: None, all).

        Returns:
            Outputs of shape ``(S, *model(x).shape)``.
        """
        if not isinstance(linear, bool):
            raise TypeError(f"Invalid linear: {linear!r} (expected True or False)")
        num_samples = check_positive_int("num_samples", num_samples)
        samples = self.sample(num_samples, generator=generator)
        return predict_samples(
            self.model, self._fitted()[0], samples, x, linear=linear, chunk_size=chunk_size
        )


class Laplace(_Gaussian):
    r"""Gaussian approximation :math:`\mathcal N(\theta_*, T\Lambda^{-1})` at a trained model.

    .. math::

        \Lambda = \Lambda_0 + \frac{N}{n}\sum_{i=1}^n C_i(\theta_*), \qquad
        C_i = J_i^\top H_i J_i \;(\text{ggn}) \;\text{ or }\;
        \nabla\ell_i\nabla\ell_i^\top \;(\text{ef}),

    with :math:`\Lambda_0` = ``prior_precision``, N = ``num_data``, T = ``temperature``,
    n the examples seen by :meth:`fit`, :math:`\ell_i` the per-example negative
    log-likelihood of ``likelihood`` and :math:`\theta_*` the model's weights when
    :meth:`fit` runs. Only parameters with ``requires_grad=True`` at construction (or
    those named by ``subset``) are treated; the others stay at the model's values in
    every sample.

    Args:
        model: the trained network; its output for a batch has the batch first.
        num_data: the number of training examples N (required, a positive integer).
        likelihood: ``"classification"`` (softmax cross-entropy on ``(batch, classes)``
            logits; targets are class indices or probabilities), ``"regression"``
            (Gaussian with standard deviation ``noise_std``; targets shaped like the
            output) or a callable ``log_likelihood(output, target)`` returning one
            log-likelihood per example, shape ``(batch,)`` (its output Hessian, for the
            GGN, is computed by autograd and its negative eigenvalues clipped).
        noise_std: the Gaussian noise scale σ for ``likelihood="regression"`` (default:
            None, meaning 1.0; a finite number > 0). Must be None otherwise.
        curvature: ``"ggn"`` (default; the Fisher for these likelihoods) or ``"ef"``
            (the empirical Fisher).
        structure: ``"diag"`` (default), ``"dense"`` (a P x P precision over the P
            treated scalars; refused with the size when it cannot fit in memory) or
            ``"kron"`` (KFAC: a Kronecker factor pair per ``nn.Linear``/``nn.Conv2d``
            layer, bias inside the factor, a diagonal for other parameters; memory
            :math:`O(\sum d_\text{in}^2 + d_\text{out}^2)`; see
            :mod:`samplers_as_optim.gaussian.kfac`).
        prior_precision: :math:`\Lambda_0` (default: 1.0). A finite number > 0 for the
            prior :math:`\mathcal N(0, 1/\Lambda_0)` on every weight, i.e. ``num_data *
            weight_decay``; or a dict name -> tensor of positive per-weight precisions;
            or, with ``structure="dense"``, a P x P positive-definite matrix. The last
            two are what :attr:`precision` returns, so a fitted posterior can be the next
            task's prior. ``structure="kron"`` takes a number only.
        temperature: T, multiplies the covariance (default: 1.0; a finite number >= 0;
            0 gives the point mass at :math:`\theta_*`). The fit does not depend on it:
            set ``la.temperature = T`` after ``fit`` to sweep temperatures without
            refitting.
        subset: the weights the Gaussian covers (default: None, every parameter with
            ``requires_grad=True``): ``"last_layer"`` (the parameters requiring grad of
            the last module, in ``model.named_modules()`` order, that owns any) or a
            list of names from ``model.named_parameters()``. The rest stay at the MAP in
            every sample and prediction.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from samplers_as_optim.gaussian.laplace import Laplace
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        >>> x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
        >>> # ... train the model (to the MAP), then:
        >>> la = Laplace(model, num_data=64, likelihood="classification")
        >>> la = la.fit(DataLoader(TensorDataset(x, y), batch_size=16))
        >>> samples = la.sample(8, generator=torch.Generator().manual_seed(1))
        >>> samples["0.weight"].shape
        torch.Size([8, 16, 4])
        >>> logits = la.predict(x[:5], num_samples=8, linear=True)
        >>> logits.shape
        torch.Size([8, 5, 3])
        >>> probs = logits.softmax(-1).mean(0)  # Bayesian model average
        >>> torch.allclose(probs.sum(-1), torch.ones(5))
        True
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_data: int,
        likelihood: str | Callable[[Tensor, Tensor], Tensor],
        noise_std: float | None = None,
        curvature: str = "ggn",
        structure: str = "diag",
        prior_precision: Precision = 1.0,
        temperature: float = 1.0,
        subset: str | Sequence[str] | None = None,
    ) -> None:
        self.treated = select_subset(model, subset)
        self.model = model
        self.num_data = check_num_data(num_data)
        self.likelihood = make_likelihood(likelihood, noise_std)
        #: The Gaussian noise scale of ``likelihood="regression"`` (None otherwise).
        self.noise_std: float | None = getattr(self.likelihood, "noise_std", None)
        self.curvature = check_choice("curvature", curvature, ("ggn", "ef"))
        self.structure = check_choice("structure", structure, ("diag", "dense", "kron"))
        self.temperature = temperature
        reference = self._reference()
        if self.structure == "dense":
            check_dense_fits(self.treated.numel, reference.dtype, reference.device)
        if self.structure == "kron" and isinstance(prior_precision, (Mapping, Tensor)):
            raise ValueError(
                f"Invalid prior_precision: a {type(prior_precision).__name__} (expected a "
                "finite number > 0 with structure='kron')"
            )
        self.prior_precision = self._check_prior(prior_precision)
        #: The treated parameter names (the subset the Gaussian covers).
        self.subset: tuple[str, ...] = self.treated.names
        self._mean = None
        self._precision = None
        self._cholesky = None

    # ------------------------------------------------------------------ fitting
    def fit(self, loader: Iterable[Any]) -> Laplace:
        r"""Compute :math:`\Lambda` in one pass over ``loader`` at the current weights.

        Each batch is a pair ``(inputs, targets)``, moved to the parameters' device. The
        model runs in eval mode during the pass (examples must not interact) and its
        mode is restored afterwards. Calling :meth:`fit` again starts from scratch.

        Args:
            loader: an iterable of ``(inputs, targets)`` batches, e.g. a ``DataLoader``.

        Returns:
            ``self``, so that ``Laplace(...).fit(loader)`` chains.

        Raises:
            ValueError: a batch's inputs, targets or model outputs hold NaN or inf, or the
                summed curvature overflowed (for every ``structure`` and ``subset``); the
                loader yielded nothing; a dense precision is not positive definite. A
                refused fit leaves the previous fit (or none) in place.
        """
        if self.structure == "kron":
            return self._fit_kron(loader)
        ref = self._reference()
        mean = self.treated.current(self.model)
        dense = self.structure == "dense"
        total: Any = (
            DenseSum(self.model, self.treated, self.likelihood, self.curvature)
            if dense
            else {name: torch.zeros_like(value) for name, value in mean.items()}
        )
        seen = 0
        training = self.model.training
        self.model.eval()
        try:
            for batch in loader:
                inputs, targets = _split_batch(batch)
                inputs, targets = inputs.to(ref.device), targets.to(ref.device)
                if dense:
                    total.add(inputs, targets)
                else:
                    part = diag_curvature(
                        self.model, self.treated, inputs, targets, self.likelihood, self.curvature
                    )
                    for name in self.treated.names:
                        total[name] += part[name]
                seen += inputs.shape[0]
        finally:
            self.model.train(training)
        if seen == 0:
            raise ValueError("Invalid loader: it yielded no examples (expected one pass over data)")
        scale = self.num_data / seen
        prior = self._prior_flat()
        if dense:
            precision = prior + scale * total.result(ref)
            precision = 0.5 * (precision + precision.T)
            check_finite_curvature([precision], precision.dtype)
            cholesky, info = torch.linalg.cholesky_ex(precision)
            if info != 0:
                raise ValueError(
                    "Invalid precision: the fitted dense precision is not positive definite "
                    f"in {precision.dtype} (expected prior_precision large enough to dominate "
                    "round-off; increase it or use float64)"
                )
            self._precision, self._cholesky = precision, cholesky
        else:
            flat = prior + scale * self.treated.flatten(total)
            check_finite_curvature([flat], flat.dtype)
            self._precision = self.treated.unflatten(flat)
            self._cholesky = None
        self._mean = mean
        return self

    def _fit_kron(self, loader: Iterable[Any]) -> Laplace:
        ref = self._reference()
        mean = self.treated.current(self.model)
        layers = kron_layers(self.model, self.treated)
        sums: list[KronSums] | None = None
        diag: dict[str, Tensor] = {}
        seen = 0
        training = self.model.training
        self.model.eval()
        try:
            for batch in loader:
                inputs, targets = _split_batch(batch)
                inputs, targets = inputs.to(ref.device), targets.to(ref.device)
                part, part_diag = kron_curvature(
                    self.model,
                    self.treated,
                    layers,
                    inputs,
                    targets,
                    self.likelihood,
                    self.curvature,
                )
                if sums is None:
                    sums = part
                else:
                    for total, item in zip(sums, part, strict=True):
                        total.g += item.g
                        total.a += item.a
                        total.rows += item.rows
                for name, value in part_diag.items():
                    diag[name] = diag[name] + value if name in diag else value
                seen += inputs.shape[0]
        finally:
            self.model.train(training)
        if seen == 0 or sums is None:
            raise ValueError("Invalid loader: it yielded no examples (expected one pass over data)")
        prior = self.prior_precision
        assert isinstance(prior, float)
        shapes = dict(zip(self.treated.names, self.treated.shapes, strict=True))
        self._precision = build_precision(
            self.treated, sums, diag, self.num_data / seen, prior, shapes
        )
        self._cholesky = None
        self._mean = mean
        return self
