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

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.validation import check_choice, check_num_data
from ._memory import check_dense_fits
from ._per_example_curvature import DenseSum, check_finite_curvature, diag_curvature
from ._weight_gaussian import Precision, _batches_on, _evaluating, _Gaussian, select_subset
from .kfac import KronSums, build_precision, kron_curvature, kron_layers
from .likelihoods import make_likelihood

__all__ = ["Laplace"]


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
        with _evaluating(self.model):
            for inputs, targets in _batches_on(loader, ref.device):
                if dense:
                    total.add(inputs, targets)
                else:
                    part = diag_curvature(
                        self.model, self.treated, inputs, targets, self.likelihood, self.curvature
                    )
                    for name in self.treated.names:
                        total[name] += part[name]
                seen += inputs.shape[0]
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
        with _evaluating(self.model):
            for inputs, targets in _batches_on(loader, ref.device):
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
