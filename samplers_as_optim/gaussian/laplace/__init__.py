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

``"lowrank"`` keeps the curvature's top-k eigenpairs (block Lanczos on batched products,
a few passes) and the diagonal of the rest, every operation exact in O(kP) memory
(Daxberger et al. 2021, §3.2; :mod:`._lowrank`, :mod:`._lowrank_fit`).

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

The evidence (:meth:`Laplace.log_marginal_likelihood`, MacKay 1992; Immer et al. 2021,
eq. 3-4) is computed from what :meth:`Laplace.fit` keeps (the curvature without the prior
and the data term; :mod:`samplers_as_optim.gaussian.laplace._evidence`), so the prior precision
and the regression noise are tuned without a new pass
(:meth:`Laplace.optimize_prior_precision`; during training:
:func:`samplers_as_optim.gaussian.laplace.marglik.marglik_training`).

:meth:`Laplace.optimize_prior_precision`'s ``method="gridsearch"`` scores every value δ
of its ``grid`` as a scalar prior precision by the validation negative log-likelihood
:math:`-\sum_i\log p(y_i\mid x_i)` of the GLM predictive (:meth:`Laplace.predictive`) at
the current ``temperature`` (and ``noise_std``): for regression the exact Gaussian
:math:`\mathcal N(f(x;\theta_*), \mathrm{diag}\,TJ\Lambda_\delta^{-1}J^\top + \sigma^2)`,
for classification the closed form of ``link_approx`` (default ``"probit"``,
laplace-torch's default), or with ``link_approx="mc"`` ``num_samples`` function-space
draws, the same draws for every δ (batch b's from a generator seeded with b, as
``predictive(x, link_approx="mc", generator=torch.Generator().manual_seed(b))`` draws
them); the lowest wins (the first of equal ones). Each batch's Jacobians are computed
once for the whole grid, in the eigenbasis of the stored curvature (diagonal; the KFAC
factors' eigenvectors; one ``eigh`` of a dense curvature), so each δ costs a product with
:math:`1/(\delta + e)`, not a refit (:mod:`~samplers_as_optim.gaussian.laplace._prior_grid`).
laplace-torch 0.3's ``optimize_prior_precision(method, n_steps, lr, init_prior_prec,
prior_structure, val_loader, log_prior_prec_min, log_prior_prec_max, grid_size,
link_approx, n_samples)`` maps to ``method``, ``num_steps``, ``lr``,
``init_prior_precision``, ``prior_structure``, ``val_loader``, ``grid`` (e.g.
``torch.logspace(-4, 4, 100).tolist()``), ``link_approx`` and ``num_samples``; it never
tunes the noise, here ``tune_noise`` does (``la.noise_std`` is its ``sigma_noise``).

References:
    MacKay (1992), A practical Bayesian framework for backpropagation networks.
    Immer, Bauer, Fortuin, Rätsch & Khan (2021), Scalable marginal likelihood estimation
    for model selection in deep learning, eq. 3-4 and Algorithm 1.
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

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...core.progress import progress_bar
from ...core.validation import check_choice, check_num_data, check_positive
from .._memory import check_dense_fits
from .._per_example_curvature import DenseSum, check_finite_curvature, diag_curvature
from .._weight_gaussian import Precision, _Gaussian, batches_on, evaluating, select_subset
from .._wide_linalg import factor_sum, wide_dtype
from ..kfac import KronCurvature, KronSums, decompose_curvature, kron_curvature, kron_layers
from ..likelihoods import Regression, check_noise_argument, check_noise_std, make_likelihood
from ._evidence import (
    DataSums,
    FitTerms,
    curvature_scale,
    data_term,
    log_marginal_likelihood,
)
from ._lowrank import LowRankCurvature
from ._lowrank_fit import check_rank, fit_lowrank
from ._prior_forms import block_priors, prior_groups, read_prior
from ._prior_search import PriorTuning

__all__ = ["Laplace"]


class Laplace(_Gaussian, PriorTuning):
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
        num_data: the number of training examples N (required, a positive integer): for
            outputs with positions, the number of sequences, not of tokens (each
            example's log-likelihood is its sum over positions; n, the examples
            :meth:`fit` sees, counts sequences too).
        likelihood: ``"classification"`` (softmax cross-entropy on ``(batch, classes)``
            logits, or ``(batch, *positions, classes)`` ones such as a causal language
            model's ``(batch, sequence, vocabulary)``, one observation per position;
            targets are class indices of an integer dtype in ``[0, classes)`` of shape
            ``(batch, *positions)``, or probabilities of the logits' shape),
            ``"regression"`` (Gaussian with standard deviation ``noise_std``; targets
            shaped like the output, ``(batch, *positions, outputs)`` read as one
            observation per position) or a callable ``log_likelihood(output, target)``
            returning one log-likelihood per example, shape ``(batch,)`` (its output
            Hessian, for the GGN, is computed by autograd and its negative eigenvalues
            clipped). Per position, the GGN is :math:`\sum_t J_{it}^\top H_{it}J_{it}`
            and the empirical Fisher :math:`\sum_t\nabla\ell_{it}\nabla\ell_{it}^\top`
            (see :mod:`samplers_as_optim.gaussian.likelihoods`).
        noise_std: the Gaussian noise scale σ for ``likelihood="regression"`` (default:
            None, meaning 1.0; a finite number > 0). Must be None otherwise. Settable
            after :meth:`fit` without a new pass; tuned by the evidence
            (:meth:`optimize_prior_precision`).
        curvature: ``"ggn"`` (default; the Fisher for these likelihoods) or ``"ef"``
            (the empirical Fisher).
        structure: ``"diag"`` (default), ``"dense"`` (a P x P precision over the P
            treated scalars; refused with the size when it cannot fit in memory) or
            ``"kron"`` (KFAC: a Kronecker factor pair per ``nn.Linear``/``nn.Conv2d``
            layer, bias inside the factor, a diagonal for other parameters; memory
            :math:`O(\sum d_\text{in}^2 + d_\text{out}^2)`; see
            :mod:`samplers_as_optim.gaussian.kfac`). A float16/bfloat16 model's
            factorisations run in float32, its results keep its dtype (see
            :mod:`samplers_as_optim.gaussian._wide_linalg`); or ``"lowrank"``: the top
            ``rank`` eigenpairs of the curvature plus the diagonal of the rest, O(kP)
            memory, a few passes over the loader (:mod:`._lowrank`).
        rank: ``structure="lowrank"``'s k in [1, P] (default: None, ``min(P, 20)``), or
            a float f in (0, 1): the fewest eigenpairs holding f of the curvature's
            trace; None with the other structures. The fitted k: ``la.precision.rank``.
        prior_precision: :math:`\Lambda_0` (default: 1.0). A finite number > 0 for the
            prior :math:`\mathcal N(0, 1/\Lambda_0)` on every weight, i.e. ``num_data *
            weight_decay``; a 1-d tensor with one value per treated tensor (the order of
            :attr:`subset`: one per layer); a dict name -> positive number (one per
            tensor) or tensor of the parameter's shape (one per weight), or a 1-d tensor
            of P values; or, with ``structure="dense"``, a P x P positive-definite
            matrix. A diagonal or dense :attr:`precision` is such a prior, so a fitted
            posterior can be the next task's prior. ``structure="kron"`` keeps one prior
            precision per layer (:attr:`KronBlock.prior
            <samplers_as_optim.gaussian.kfac.KronBlock.prior>`): a number, or one number
            per treated tensor with the same value for a layer's weight and bias (they
            share one Kronecker factor pair); a prior that varies within a tensor is
            refused there. ``"lowrank"`` takes ``"diag"``'s forms. Settable after
            :meth:`fit` (the posterior is rebuilt from the stored curvature); tuned by
            :meth:`optimize_prior_precision`.
        temperature: T, multiplies the covariance (default: 1.0; a finite number >= 0;
            0 gives the point mass at :math:`\theta_*`). The fit does not depend on it:
            set ``la.temperature = T`` after ``fit`` to sweep temperatures without
            refitting.
        subset: the weights the Gaussian covers (default: None, every parameter with
            ``requires_grad=True``): ``"last_layer"`` (the parameters requiring grad of
            the last module, in ``model.named_modules()`` order, that owns any) or a
            list of names from ``model.named_parameters()``. The rest stay at the MAP in
            every sample and prediction.
        ignore_index: ``likelihood="classification"`` only (default: None): positions
            (or examples) whose class-index target equals it add nothing to the
            curvature, the log-likelihood or the evidence, as in
            ``torch.nn.CrossEntropyLoss(ignore_index=-100)`` for padding; any integer
            (one in ``[0, classes)`` ignores that class). They still count in n.

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
        rank: int | float | None = None,
        prior_precision: Precision = 1.0,
        temperature: float = 1.0,
        subset: str | Sequence[str] | None = None,
        ignore_index: int | None = None,
    ) -> None:
        self.treated = select_subset(model, subset)
        self.model = model
        self.num_data = check_num_data(num_data)
        self.likelihood = make_likelihood(likelihood, noise_std, ignore_index)
        self.curvature = check_choice("curvature", curvature, ("ggn", "ef"))
        self.structure = check_choice("structure", structure, ("diag", "dense", "kron", "lowrank"))
        #: ``structure="lowrank"``'s k (an int) or trace fraction (a float); else None.
        self.rank = check_rank(rank, self.structure, self.treated.numel)
        self.temperature = temperature
        reference = self._reference()
        if self.structure == "dense":
            # the precision, its factor, a transient and the curvature kept for the evidence
            # (counted in float32 for a half-precision model, whose factor is float32)
            wide = wide_dtype(reference.dtype)
            check_dense_fits(self.treated.numel, wide, reference.device, copies=4)
        self._groups = prior_groups(model, self.treated, self.structure)
        self._terms: FitTerms | None = None
        self._mean = None
        self._precision = None
        self._cholesky = None
        self._prior: float | dict[str, Tensor] | Tensor = self._check_prior(prior_precision)
        #: The treated parameter names (the subset the Gaussian covers).
        self.subset: tuple[str, ...] = self.treated.names

    # ------------------------------------------------------------------ hyperparameters
    def _check_prior(self, prior: Any) -> float | dict[str, Tensor] | Tensor:
        flat, form = read_prior(
            prior,
            self.treated,
            self._reference(),
            structure=self.structure,
            groups=self._groups,
        )
        flat = flat.detach().clone()
        if form == "scalar":
            return float(flat[0])
        if form == "matrix":
            return flat
        return {name: value.clone() for name, value in self.treated.unflatten(flat).items()}

    @property
    def prior_precision(self) -> float | dict[str, Tensor] | Tensor:
        r""":math:`\Lambda_0`: a float, a dict name -> per-weight tensor, or a (P, P) matrix.

        Settable (any form the constructor takes); a fitted posterior is rebuilt from the
        stored curvature, without a new pass over the data.
        """
        return self._prior

    @prior_precision.setter
    def prior_precision(self, value: Precision) -> None:
        self._set_hyperparameters(value, None)

    @property
    def noise_std(self) -> float | None:
        """σ of ``likelihood="regression"`` (None otherwise); settable, rebuilds a fit.

        A finite number > 0 for regression (None is refused there: only the constructor
        reads None as 1.0); None, which changes nothing, for the other likelihoods.
        """
        return getattr(self.likelihood, "noise_std", None)

    @noise_std.setter
    def noise_std(self, value: float | None) -> None:
        if check_noise_std(self.likelihood, value) is not None:
            self._set_hyperparameters(self._prior, value)

    def _set_hyperparameters(self, prior: Precision, noise_std: float | None) -> None:
        """Set the prior (and σ, if not None) together, checked first, rebuilt once.

        Atomic: when the rebuild fails (a dense precision that is not positive definite),
        the prior and σ are put back as they were, with the posterior built from them.
        """
        checked = self._check_prior(prior)
        noise = None if noise_std is None else check_positive("noise_std", noise_std)
        before = (self._prior, self.noise_std, self._precision, self._cholesky)
        self._prior = checked
        if noise is not None:
            assert isinstance(self.likelihood, Regression)
            self.likelihood.noise_std = noise
        if self._terms is None:
            return
        try:
            self._assemble()
        except Exception:
            self._prior, old_noise, self._precision, self._cholesky = before
            if old_noise is not None:
                assert isinstance(self.likelihood, Regression)
                self.likelihood.noise_std = old_noise
            raise

    # ------------------------------------------------------------------ fitting
    def fit(self, loader: Iterable[Any], *, progress: bool | None = None) -> Laplace:
        r"""Compute :math:`\Lambda` in one pass over ``loader`` at the current weights.

        Each batch is a pair ``(inputs, targets)``, moved to the parameters' device. The
        model runs in eval mode during the pass (examples must not interact) and its
        mode is restored afterwards. Calling :meth:`fit` again starts from scratch.
        Besides :math:`\Lambda`, the fit keeps the curvature without the prior and the
        log-likelihood of the data at :math:`\theta_*` (one more forward per batch), so
        that :meth:`log_marginal_likelihood` and a new ``prior_precision`` or
        ``noise_std`` need no new pass.

        Args:
            loader: an iterable of ``(inputs, targets)`` batches, e.g. a ``DataLoader``.
            progress: a bar over the batches (default: None, shown where standard error
                is a terminal and tqdm is installed; see
                :mod:`samplers_as_optim.core.progress`).

        Returns:
            ``self``, so that ``Laplace(...).fit(loader)`` chains.

        Raises:
            ValueError: a batch's inputs, targets or model outputs hold NaN or inf, targets
                the likelihood refuses (a class index out of range, float class indices,
                regression targets not shaped like the output), or the summed curvature
                overflowed (for every ``structure`` and ``subset``); the loader yielded
                nothing; a dense precision is not positive definite; a later ``"lowrank"``
                pass (:mod:`._lowrank_fit`) that sees other examples than the first. A
                refused fit leaves the previous fit (or none) in place.
            TypeError: ``"lowrank"`` with an iterator (it cannot be passed over again).
        """
        if self.structure == "lowrank":
            with evaluating(self.model):
                self._install(self.treated.current(self.model), fit_lowrank(self, loader, progress))
            return self
        batches = progress_bar(loader, progress, "Laplace.fit")
        if self.structure == "kron":
            return self._fit_kron(batches)
        ref = self._reference()
        mean = self.treated.current(self.model)
        dense = self.structure == "dense"
        total: Any = (
            DenseSum(self.model, self.treated, self.likelihood, self.curvature)
            if dense
            else {name: torch.zeros_like(value) for name, value in mean.items()}
        )
        data = DataSums()
        with evaluating(self.model):
            for inputs, targets in batches_on(batches, ref.device):
                if dense:
                    total.add(inputs, targets)
                else:
                    part = diag_curvature(
                        self.model, self.treated, inputs, targets, self.likelihood, self.curvature
                    )
                    for name in self.treated.names:
                        total[name] += part[name]
                data.add(self.model, self.likelihood, inputs, targets)
        scale = data.scale(self.num_data)
        if dense:
            curvature = scale * total.result(ref)
            curvature = 0.5 * (curvature + curvature.T)
            check_finite_curvature([curvature], curvature.dtype)
        else:
            curvature = {name: scale * value for name, value in total.items()}
            check_finite_curvature(list(curvature.values()), ref.dtype)
        self._install(mean, data.terms(curvature, scale, self.noise_std, self.curvature))
        return self

    def _fit_kron(self, loader: Iterable[Any]) -> Laplace:
        ref = self._reference()
        mean = self.treated.current(self.model)
        layers = kron_layers(self.model, self.treated)
        sums: list[KronSums] | None = None
        diag: dict[str, Tensor] = {}
        data = DataSums()
        with evaluating(self.model):
            for inputs, targets in batches_on(loader, ref.device):
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
                data.add(self.model, self.likelihood, inputs, targets)
        scale = data.scale(self.num_data)
        assert sums is not None
        shapes = dict(zip(self.treated.names, self.treated.shapes, strict=True))
        curvature = decompose_curvature(self.treated, sums, diag, scale, shapes)
        self._install(mean, data.terms(curvature, scale, self.noise_std, self.curvature))
        return self

    def _install(self, mean: dict[str, Tensor], terms: FitTerms) -> None:
        """Build the posterior from ``terms``; keep the previous fit if that is refused."""
        previous = (self._mean, self._terms, self._precision, self._cholesky)
        self._mean, self._terms = mean, terms
        try:
            self._assemble()
        except ValueError:
            self._mean, self._terms, self._precision, self._cholesky = previous
            raise

    def _assemble(self) -> None:
        r""":math:`\Lambda = \Lambda_0 + c\,C` from the stored curvature, prior and noise."""
        terms = self._terms
        assert terms is not None
        ref = self._reference()
        prior, _ = read_prior(
            self._prior, self.treated, ref, structure=self.structure, groups=self._groups
        )
        scale = float(curvature_scale(terms, self.noise_std))
        curvature = terms.curvature
        if isinstance(curvature, KronCurvature):
            blocks = block_priors(prior, self.treated, self._groups)
            diagonal = self.treated.unflatten(prior)
            count = len(curvature.blocks)
            self._precision = curvature.precision(
                [float(value) for value in blocks[:count]], diagonal, scale
            )
            self._cholesky = None
        elif isinstance(curvature, LowRankCurvature):
            self._precision = curvature.precision(prior, scale, ref.dtype)
            self._cholesky = None
        elif isinstance(curvature, dict):
            flat = prior + scale * self.treated.flatten(curvature)
            self._precision = self.treated.unflatten(flat)
            self._cholesky = None
        else:
            matrix = prior if prior.dim() == 2 else torch.diag(prior)
            precision, cholesky, info = factor_sum(matrix, scale, curvature)
            if info != 0:
                raise ValueError(
                    "Invalid precision: the fitted dense precision is not positive definite "
                    f"in {precision.dtype} (expected prior_precision large enough to dominate "
                    "round-off; increase it or use float64)"
                )
            self._precision, self._cholesky = precision, cholesky

    # ------------------------------------------------------------------ evidence
    @property
    def log_likelihood(self) -> Tensor:
        r""":math:`\log p(D\mid\theta_*)` of the fit, scaled to N examples, at ``noise_std``.

        :math:`\frac Nn\sum_{i=1}^n\log p(y_i\mid x_i,\theta_*)` over the n examples of
        :meth:`fit`; for regression evaluated at the current ``noise_std`` (see
        :meth:`log_marginal_likelihood`).
        """
        return data_term(self._fitted_terms(), self.noise_std)

    def _fitted_terms(self) -> FitTerms:
        if self._terms is None:
            raise RuntimeError(self._not_fitted)
        return self._terms

    def log_marginal_likelihood(
        self,
        prior_precision: Precision | None = None,
        noise_std: float | Tensor | None = None,
    ) -> Tensor:
        r"""The Laplace approximation of the evidence :math:`\log p(D)` at the fitted weights.

        .. math::

            \log p(D) \approx \log p(D\mid\theta_*)
            - \tfrac12\theta_*^\top\Lambda_0\theta_*
            - \tfrac12\log\det\Lambda + \tfrac12\log\det\Lambda_0,
            \qquad \Lambda = \Lambda_0 + \frac Nn\sum_{i=1}^n C_i(\theta_*),

        (MacKay 1992; Immer et al. 2021, eq. 3-4; Daxberger et al. 2021, §2), with the
        prior :math:`\mathcal N(0,\Lambda_0^{-1})` on the treated weights (the others are
        held at :math:`\theta_*` and do not enter), :math:`\log p(D\mid\theta_*)` the
        fitted pass's log-likelihood scaled to N (:attr:`log_likelihood`) and Λ the
        precision of the structure (diag, KFAC, dense, low-rank). It is the evidence of the
        temperature-1 posterior whatever ``temperature`` is. For regression,
        :math:`\log p(D\mid\theta_*) = -\frac{NO}{2}\log(2\pi\sigma^2) -
        \mathrm{SSE}/(2\sigma^2)` and the GGN is :math:`C/\sigma^2` (the empirical
        Fisher :math:`C/\sigma^4`), both from the stored pass. The value is
        differentiable (torch autograd) in ``prior_precision`` and ``noise_std`` when
        they are tensors that require grad, so any torch optimiser can maximise it;
        :meth:`optimize_prior_precision` does.

        Args:
            prior_precision: :math:`\Lambda_0` (default: None, the current
                ``prior_precision``): a number or one-element tensor (one prior on every
                weight); a 1-d tensor with one value per treated tensor (the order of
                :attr:`subset`: "layerwise"); a 1-d tensor of P values or a dict name ->
                tensor of the parameter's shape (one per weight; refused with
                ``structure="kron"``, which takes one number per layer); with
                ``structure="dense"`` also a (P, P) matrix.
            noise_std: σ for ``likelihood="regression"`` (default: None, the current
                ``noise_std``; a number or 0-d tensor > 0); must be None otherwise.

        Returns:
            A 0-d tensor in the parameters' dtype.

        Raises:
            RuntimeError: the approximation is not fitted.
            ValueError: an argument outside the forms above.
        """
        terms = self._fitted_terms()
        ref = self._reference()
        prior, form = read_prior(
            self._prior if prior_precision is None else prior_precision,
            self.treated,
            ref,
            structure=self.structure,
            groups=self._groups,
        )
        noise = check_noise_argument(self.likelihood, noise_std)
        blocks = None
        if isinstance(terms.curvature, KronCurvature):
            blocks = block_priors(prior, self.treated, self._groups)[: len(terms.curvature.blocks)]
        mean = self.treated.flatten(self._fitted()[0])
        scalar = form == "scalar"
        return log_marginal_likelihood(terms, self.treated, mean, prior, blocks, noise, scalar)
