r"""AdamW's twin: SGHMC preconditioned by Adam's second moment; AdamW at temperature 0.

Derivation. ``torch.optim.AdamW`` takes, with :math:`g'` the gradient (negated when
``maximize``) and :math:`t` the parameter's step count,

.. math::

    m \leftarrow \beta_1 m + (1-\beta_1)\, g', \quad
    V \leftarrow \beta_2 V + (1-\beta_2)\, g'^2, \quad
    a = \sqrt{V / (1-\beta_2^t)} + \epsilon, \quad
    \theta \leftarrow (1 - lr\,\lambda)\,\theta - \frac{lr}{1-\beta_1^t}\; m / a.

Hold :math:`a` fixed and let :math:`t` be large (the bias corrections are 1). With the
displacement :math:`v = -lr\, m/a` of a step, the update is :math:`v \leftarrow \beta_1 v
- lr(1-\beta_1)\,G g'`, :math:`\theta \leftarrow \theta + v`, :math:`G = 1/a`: SGHMC
(Chen et al. 2014) with momentum :math:`\mu = \beta_1`, learning rate :math:`lr(1-\beta_1)`
in SGD units, and the constant diagonal mass :math:`M = \mathrm{diag}(a)`. The SGHMC SDE
with mass :math:`M`, step :math:`\varepsilon = \sqrt{lr(1-\beta_1)/N}` and friction
:math:`C = (1-\beta_1) M/\varepsilon` (Chen et al., Eq. 9; Ma et al. 2015's recipe with
:math:`D = \mathrm{blockdiag}(0, C)`) leaves :math:`p_T(\theta) \propto \exp(-U/T)`,
:math:`U = N L`, invariant when its momentum receives the noise
:math:`\mathcal N(0, 2CT\varepsilon)`. In :math:`v`'s units that noise has standard
deviation :math:`(1-\beta_1)\sqrt{2\,lr\,T/N}\;G^{1/2}`, and in :math:`m`'s
(:math:`v = -lr\, G m`) it is :math:`(1-\beta_1)\,\sigma\, a^{1/2}\,\xi` with
:math:`\sigma = \sqrt{2T/(N\,lr)}`. So the twin's step is AdamW's with the noise added to
the gradient that enters the momentum:

.. math::

    m \leftarrow \beta_1 m + (1-\beta_1)\,\big(g' + \sigma\, \sqrt{a}\,\xi\big), \qquad
    \theta \leftarrow (1 - lr\,\lambda)\,\theta - lr\, m / a,
    \qquad \xi \sim \mathcal N(0, I),

with :math:`a` the sampling preconditioner below. (With :math:`\beta_1 = 0` it is
preconditioned SGLD with step :math:`lr/N`.) At :math:`T = 0` the noise vanishes and the
step is ``torch.optim.AdamW``'s, computed by torch's own functional ``adam`` (bit for bit,
``amsgrad`` included; ``amsgrad`` has no sampling meaning and requires temperature 0).

The bias corrections. At temperature > 0 the momentum is **not** divided by
:math:`1-\beta_1^t`: the chain's momentum starts at 0, as SGHMC's does, and dividing it
would multiply the first steps' noise variance by :math:`1/(1-\beta_1^t)^2` (100 at
:math:`t = 1`: a full preconditioned Langevin step, with :math:`a` estimated from one
gradient, which threw elements far out where that gradient was tiny, a zero-initialised
LoRA factor, and left them there). So the steps at :math:`T > 0` differ from AdamW's
during a parameter's first :math:`\sim 1/(1-\beta_1)` steps only. :math:`1-\beta_2^t`
makes the early :math:`V` an unbiased estimate, and enters :math:`a`.

Decoupled weight decay is the prior. With :math:`a` fixed the drift is
:math:`-lr\,(G g' + \lambda\theta) = -(lr/N)\, G\, \nabla_\theta \big(N L + \tfrac{N
\lambda}{2}\, \theta^\top \mathrm{diag}(a)\, \theta\big)`: AdamW's decay is the Gaussian
prior :math:`\mathcal N(0, 1/(N \lambda a_i))` on each element (Loshchilov & Hutter
2019: decoupled decay equals an L2 penalty only with the preconditioner folded into it).
It is applied to the position directly, not through the momentum; with finite friction
that biases the prior's variance by the factor :math:`1/(1 + lr\,\lambda/(1-\beta_1))`
(the exact stationary variance of the linear chain; :math:`10^{-4}` at AdamW's defaults).
For a prior that does not depend on :math:`a`, set ``weight_decay=0`` and add
:math:`\|\theta\|^2/(2 N s^2)` to the loss: it then goes through the preconditioner as
the likelihood does, and the target is the posterior under :math:`\mathcal N(0, s^2)`.

The sampling preconditioner (:mod:`.sampling_preconditioner`). At temperature > 0,
:math:`a = \sqrt{\bar V/(1-\beta_2^t)} + \epsilon` with :math:`\bar V` AdamW's
:math:`V` pooled (Adafactor's factored estimate over the two largest dimensions, the
mean for a vector), following it during the first ``preconditioner_warmup`` steps of the
parameter and frozen at the first step at temperature > 0 past them; a step at
temperature 0 releases it. Frozen, :math:`G` is constant and the chain above is exact
up to its step-size bias, whatever :math:`a`'s value (Ma et al.'s :math:`\Gamma` is
zero): the preconditioner sets the speed, not the law. :math:`V` itself keeps AdamW's
update at every step, so a return to temperature 0 continues AdamW. A moving
preconditioner (``preconditioner_warmup=None``) would need the correction
:math:`T\,\Gamma`, :math:`\Gamma_i = \partial G_{ii}/\partial\theta_i`, which a
gradient-fed optimizer cannot compute; pooling makes it small, not zero. The figures are
``benchmarks/bench_adamw_sghmc.py``'s.

Started at a mode. The MAP's full-batch gradient vanishes, and :math:`a` built from it
would be :math:`\epsilon`: no noise exactly there, and a hair away noise
:math:`\sigma\sqrt a\,/a` that throws the chain out (issue #36: test RMSE 8.7-11.7 against
the MAP's 3-4). ``prior_weight_decay`` :math:`\lambda_0`, the curvature of the prior the
loss holds (``prior_param_groups(model, num_data=N, decoupled=True)`` sets it per
group, with ``weight_decay`` 0; the prior itself is ``prior_loss`` in the loss), floors
:math:`\bar V/c \ge T\lambda_0/N` at temperature > 0: at stationarity
:math:`E[g_i^2] = T\,E[\partial_{ii}L]/N` (integration by parts), at least the prior's
share (``sampling_preconditioner.prior_floor``). Started at its MAP, a 50-unit MLP on
scikit-learn's diabetes then samples at test RMSE 52-57 (the MAP's 52.7), where without
it the RMSE was 175-510 after 500-3,000 steps.

The learning rate. The physical momentum is :math:`r = M v/\varepsilon \propto
\sqrt{lr}\, m`, so when ``lr`` changes at temperature > 0 the momentum is re-expressed,
:math:`m \leftarrow \sqrt{lr_0/lr_1}\, m` (as SGHMC's buffer, ``docs/design.md``);
:math:`V` and :math:`a` are in the gradient's units and stay.

Cost. A frozen step is AdamW's passes over the state plus one ``addcmul`` (the noise,
drawn ahead on a worker thread or a side stream); the frozen :math:`a` and its masked
square root are kept (in their pooled shape: full-size for a matrix), so sampling holds
five tensors per parameter where AdamW holds three.

Half precision. A float16 or bfloat16 parameter samples through a float32 master copy
(``step/half_precision``): ``eps``, :math:`V` and :math:`1/a` stay in float32, where float16
would round ``eps`` to 0 and overflow :math:`1/a`. Not supported at temperature > 0:
DTensor parameters (the pooled means would need a collective), and
``torch.compile`` in one graph (the step counts are read in Python, as
``torch.optim.AdamW`` reads them without ``capturable``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ...core.validation import check_bool, check_nonnegative, refuse, user_stacklevel
from ..definition import (
    Hyperparameter,
    SamplerDefinition,
    StateField,
    UpdateInput,
    UpdateOutput,
    zeros_like_param,
)
from ..definition.arguments import (
    DIFFERENTIABLE,
    FOREACH,
    FUSED,
    MAXIMIZE,
    NONFINITE,
    NUM_DATA,
    OVERLAP_NOISE,
    SEED,
    TEMPERATURE,
    WEIGHT_DECAY,
    pick,
    sampling_meaningless,
)
from ..definition.noise_scales import adamw_sghmc_noise_scale, torch_adamw_step
from ..optimizer import SamplerOptimizer
from ..sampling_preconditioner import (
    FROZEN_AT,
    FROZEN_PRECONDITIONER,
    PRECONDITIONER,
    PRECONDITIONER_WARMUP,
    STEP,
    check_eps,
    lr_in_units_of,
    zero_temperature_only,
)
from .temperature import ADAMW_SGHMC_RULE
from .update import Settings, directions

__all__ = [
    "DEFINITION",
    "AdamWSGHMC",
    "adamw_sghmc_direction",
    "adamw_sghmc_noise_scale",
]


def _check_betas(value: Any, where: str) -> tuple[float, float]:
    expected = "a pair of numbers in [0, 1)"
    if not isinstance(value, tuple | list) or len(value) != 2:
        refuse("betas", value, expected, where, TypeError)
    for beta in value:
        if isinstance(beta, bool) or not isinstance(beta, int | float):
            refuse("betas", value, expected, where, TypeError)
        if not (math.isfinite(beta) and 0.0 <= beta < 1.0):
            refuse("betas", value, expected, where)
    return float(value[0]), float(value[1])


def adamw_sghmc_direction(
    params: list[Tensor],
    grads: list[Tensor],
    steps: list[Any],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    noise: list[Tensor] | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    temperature: float,
    num_data: int,
    maximize: bool,
    amsgrad: bool = False,
    max_exp_avg_sqs: list[Tensor] | None = None,
    preconditioners: list[Tensor | None] | None = None,
    roots: list[Tensor | None] | None = None,
    frozen_at: list[Any] | None = None,
    preconditioner: str = "factored",
    preconditioner_warmup: int | None = 1000,
    inplace: bool = True,
    prior_weight_decay: float = 0.0,
) -> tuple[list[Tensor], dict[str, list[Any]]]:
    r"""The pure kernel of :class:`AdamWSGHMC`: the directions :math:`d` and the new state.

    The step is :math:`\theta \leftarrow \theta - lr\, d` with

    .. math::

        d = \lambda\theta + m / a \;\; (\text{over } 1-\beta_1^t \text{ at } T = 0), \qquad
        m \leftarrow \beta_1 m + (1-\beta_1)\big(g' + \sigma\sqrt{a}\,\xi\big),

    :math:`V` updated as AdamW's, :math:`a` AdamW's own denominator at temperature 0 and
    the pooled, frozen sampling preconditioner at temperature > 0 (module docstring).
    Computed one parameter at a time in ``adamw_sghmc/update``.

    Args:
        params: the parameters (read only, for the weight decay).
        grads: their gradients (never modified).
        steps: each parameter's step count :math:`t` before this step (a 0-d CPU tensor,
            as ``torch.optim.AdamW`` keeps it, or a float).
        exp_avgs: :math:`m`, one per parameter.
        exp_avg_sqs: :math:`V`, one per parameter.
        noise: standard-normal :math:`\xi` per parameter; None exactly when T is 0.
        lr: learning rate, > 0 when ``temperature`` > 0.
        beta1: :math:`\beta_1 \in [0, 1)`.
        beta2: :math:`\beta_2 \in [0, 1)`.
        eps: :math:`\epsilon > 0`.
        weight_decay: :math:`\lambda`, AdamW's decoupled weight decay.
        temperature: T >= 0.
        num_data: N.
        maximize: ascend instead.
        amsgrad: AdamW's variant (temperature 0 only).
        max_exp_avg_sqs: the running maxima of :math:`V` when ``amsgrad``.
        preconditioners: the frozen :math:`a` per parameter (None before a freeze).
        roots: the frozen :math:`\sqrt{a}` per parameter, 0 where :math:`a` has no scale
            (None before a freeze).
        frozen_at: the step at which each was frozen, 0 when it is not (as ``steps``).
        preconditioner: ``"factored"`` or ``"elementwise"`` pooling.
        preconditioner_warmup: the steps before the preconditioner freezes (None: never).
        inplace: update the given buffers in place (an Optimizer) or return new ones.
        prior_weight_decay: :math:`\lambda_0`: at temperature > 0 the floor
            :math:`T\lambda_0/N` of :math:`\bar V/c` (``sampling_preconditioner``).

    Returns:
        ``(directions, state)``: ``state`` maps ``"step"``, ``"exp_avg"``,
        ``"exp_avg_sq"``, ``"max_exp_avg_sq"``, ``"preconditioner"``,
        ``"preconditioner_root"`` and ``"preconditioner_step"`` to their new values.
    """
    rates = (lr, beta1, beta2, eps, weight_decay, temperature, num_data, maximize)
    options = (amsgrad, preconditioner, preconditioner_warmup, inplace, prior_weight_decay)
    sigma = adamw_sghmc_noise_scale(lr, temperature, num_data)
    frozen = (max_exp_avg_sqs, preconditioners, roots, frozen_at)
    settings = Settings(*rates, *options)
    return directions(params, grads, steps, exp_avgs, exp_avg_sqs, noise, settings, sigma, *frozen)


def _check(group: Mapping[str, Any], temperature: float, where: str) -> None:
    sampling_meaningless("amsgrad", group["amsgrad"], False, temperature, where)
    if group.get("l2_prior") is True and group["weight_decay"] != 0:  # priors.PRIOR_GROUP_KEY
        raise ValueError(
            f"Invalid weight_decay{where}: {group['weight_decay']!r}, the L2 prior of "
            "prior_param_groups (expected a group without its 'l2_prior' marker: "
            "AdamWSGHMC's weight_decay is AdamW's decoupled decay, the prior "
            "N(0, 1/(N weight_decay a)) with a the preconditioner, not prior_param_groups' "
            "N(0, v); give AdamWSGHMC prior_param_groups(model, num_data=N, "
            "decoupled=True) and add prior_loss(model, num_data=N) to the loss)"
        )


def _update(
    group: Mapping[str, Any], inputs: UpdateInput, *, foreach: bool, inplace: bool
) -> UpdateOutput:
    buffers = inputs.buffers
    beta1, beta2 = group["betas"]
    return adamw_sghmc_direction(
        inputs.params,
        inputs.grads,
        buffers["step"],
        buffers["exp_avg"],
        buffers["exp_avg_sq"],
        inputs.noise,
        beta1=float(beta1),
        beta2=float(beta2),
        **pick(group, "lr", "eps", "weight_decay", "temperature", "num_data", "maximize"),
        **pick(group, "amsgrad", "preconditioner", "preconditioner_warmup", "prior_weight_decay"),
        max_exp_avg_sqs=buffers.get("max_exp_avg_sq"),
        preconditioners=buffers["preconditioner"],
        roots=buffers["preconditioner_root"],
        frozen_at=buffers["preconditioner_step"],
        inplace=inplace,
    )


def _adamw_step(group: Mapping[str, Any], inputs: UpdateInput, *, foreach: bool) -> bool:
    """At temperature 0: ``torch.optim.AdamW``'s step, by torch's own functional Adam."""
    buffers = inputs.buffers
    state = [buffers[name] for name in ("exp_avg", "exp_avg_sq")]
    state += [buffers.get("max_exp_avg_sq") or [], buffers["step"]]
    options = {"foreach": foreach, "fused": None, "grad_scale": None, "found_inf": None}
    torch_adamw_step(group, [inputs.params, inputs.grads, *state], **options)
    flags = [flag for flag in buffers["preconditioner_step"] if isinstance(flag, Tensor)]
    if flags:
        torch._foreach_zero_(flags)  # a step of AdamW releases the sampling preconditioner
    return True


DEFINITION = SamplerDefinition(
    name="AdamWSGHMC",
    transform_name="adamw_sghmc",
    # torch.optim.AdamW's signature, then the sampler's own arguments
    hyperparameters=(
        lr_in_units_of("torch.optim.AdamW", 1e-3),
        Hyperparameter(
            "betas",
            default=(0.9, 0.999),
            annotation="tuple[float, float]",
            doc=r"""betas: :math:`(\beta_1, \beta_2)`, the decays of the running
            averages of the gradient and of its square (default: (0.9, 0.999); each in
            [0, 1)). :math:`\beta_1` is the chain's momentum, :math:`1-\beta_1` its
            friction per step.""",
            transform_doc=r"""betas: :math:`(\beta_1, \beta_2)` (default: (0.9, 0.999);
            each in [0, 1)).""",
            check=lambda value, where: _check_betas(value, where),
            positional=True,
        ),
        Hyperparameter(
            "eps",
            default=1e-8,
            doc=r"""eps: :math:`\epsilon`, added to :math:`\sqrt{V}` (default: 1e-8; a
            finite number > 0).""",
            check=lambda value, where: check_eps(value, where),
            positional=True,
        ),
        WEIGHT_DECAY.replace(
            default=1e-2,
            doc=r"""weight_decay: :math:`\lambda`, AdamW's decoupled weight decay
            (default: 1e-2; a finite number >= 0). At temperature > 0 it is the Gaussian
            prior :math:`\mathcal N(0, 1/(N \lambda a))` on each element, :math:`a` the
            frozen preconditioner (see the class docstring); for an isotropic prior, set
            it to 0 and put the prior in the loss. A group of ``prior_param_groups``
            (an L2 prior, marked ``"l2_prior"``) with a decay other than 0 is
            refused.""",
            positional=True,
        ),
        zero_temperature_only(
            "amsgrad",
            False,
            "AdamW's AMSGrad variant",
            lambda value, where: check_bool("amsgrad", value, where=where),
        ),
        MAXIMIZE,
        FOREACH,
        Hyperparameter(
            "capturable",
            default=False,
            annotation="bool",
            doc=r"""capturable: accepted for compatibility with ``torch.optim.AdamW``;
            only False is supported (an option of the optimizer, not kept in the
            param groups).""",
            transform=False,
            kept=False,
        ),
        DIFFERENTIABLE.replace(
            doc=r"""differentiable: accepted for compatibility with
            ``torch.optim.AdamW``; only False is supported."""
        ),
        Hyperparameter(
            "fused",
            default=None,
            annotation="bool | None",
            doc=r"""fused: as ``torch.optim.AdamW``'s (default: None, unfused until the
            kernels have run on a GPU; True: fused, or a ``ValueError`` saying why not;
            False: never). At temperature > 0 the step is one Triton kernel per tensor
            (``adamw_sghmc/triton_kernel``; the preconditioner's pooling, a reduction, runs
            before it on the device while it is not frozen), drawing its noise from
            another stream than the unfused step (Triton's Philox); at temperature 0 it is
            ``torch.optim.AdamW(fused=True)``'s step, by torch's functional Adam. The
            gradients are checked on the device: with ``nonfinite="raise"`` a non-finite
            gradient is reported at the next ``step()`` or ``state_dict()`` call, the
            refused step having changed nothing.""",
            transform_doc=FUSED.transform_doc,
        ),
        NUM_DATA,
        TEMPERATURE,
        Hyperparameter(
            "prior_weight_decay",
            default=0.0,
            annotation="float",
            doc=r"""prior_weight_decay: :math:`\lambda_0`, the curvature of the prior the
            loss holds, as the weight decay that would add its gradient
            (``prior_loss``'s :math:`1/(N v)`; ``prior_param_groups(...,
            decoupled=True)`` sets it per group, and for a module whose prior is in its
            own loss the curvature that loss declares: ``GaussianLikelihood``'s log sigma,
            2 per observation). At temperature > 0 it floors the
            sampling preconditioner, :math:`\bar V/c \ge T\lambda_0/N` (the stationary
            second moment of the gradient is at least the prior's share), so that a chain
            started at a mode does not build :math:`a` from vanishing gradients and blow
            up (class docstring); the law is unchanged, and so is temperature 0 (AdamW).
            Default 0: no floor.""",
            check=lambda value, where: check_nonnegative("prior_weight_decay", value, where=where),
        ),
        PRECONDITIONER,
        PRECONDITIONER_WARMUP,
        SEED,
        OVERLAP_NOISE,
        NONFINITE,
    ),
    state=(
        STEP,
        StateField("exp_avg", ":math:`m` per leaf, starting at zero.", init=zeros_like_param),
        StateField("exp_avg_sq", ":math:`V` per leaf, starting at zero.", init=zeros_like_param),
        StateField(
            "max_exp_avg_sq",
            "the running maximum of :math:`V` per leaf (empty unless ``amsgrad``).",
            used=lambda group: bool(group["amsgrad"]),
            init=zeros_like_param,
        ),
        FROZEN_PRECONDITIONER,
        StateField(
            "preconditioner_root",
            "the frozen :math:`\\sqrt{a}` per leaf, 0 where :math:`a` has no scale (absent "
            "before the first freeze).",
        ),
        FROZEN_AT,
    ),
    update=_update,
    temperature_rule=ADAMW_SGHMC_RULE,
    example="lr=1e-3",
    check=_check,
    momentum_in_lr_units=True,
    momentum_buffer="exp_avg",
    chunked_kernel=False,
    supports_dtensor=False,
    dtensor_unsupported_reason="its pooled preconditioner takes means over whole tensors",
    zero_temperature_step=_adamw_step,
    optimizer_doc=r"""SGHMC preconditioned by Adam's second moment, a drop-in for AdamW.

    Each step is one transition of the Markov chain

    .. math::

        m &\leftarrow \beta_1 m + (1-\beta_1)\big(g' + \sqrt{{2T/(N\,lr)}}\,\sqrt{{a}}\,
        \xi\big), \qquad V \leftarrow \beta_2 V + (1-\beta_2)\, g'^2, \\
        \theta &\leftarrow (1 - lr\,\lambda)\,\theta - lr\,m / a,
        \qquad \xi \sim \mathcal N(0, I),

    SGHMC (Chen et al. 2014) with momentum :math:`\beta_1` and the diagonal mass
    :math:`a`, in AdamW's units, with :math:`g'` = ``±p.grad`` (the gradient of the mean
    minibatch loss), :math:`t` the parameter's step count, :math:`\lambda` =
    ``weight_decay``, :math:`T` = ``temperature``, :math:`N` = ``num_data``. At
    ``temperature=0`` it is ``torch.optim.AdamW`` with the same arguments, bit for bit
    (torch's own functional Adam takes the step), and an AdamW checkpoint loads and
    continues (AdamW divides :math:`m` by :math:`1-\beta_1^t`; at temperature > 0 the
    momentum starts at 0 undivided, as SGHMC's). At temperature > 0 :math:`a` is the
    sampling preconditioner: AdamW's
    :math:`\sqrt{{V/(1-\beta_2^t)}} + \epsilon` pooled over each tensor (Adafactor's
    factored estimate), following :math:`V` for ``preconditioner_warmup`` steps and then
    frozen, so that the chain samples

    .. math::

        p_T(\theta) \propto \exp\!\Big(-\frac{{N}}{{T}}\big(L(\theta) +
        \tfrac{{\lambda}}{{2}}\, \theta^\top \mathrm{{diag}}(a)\, \theta\big)\Big),

    AdamW's decoupled decay being the prior :math:`\mathcal N(0, 1/(N\lambda a))`. The
    derivation, the bias corrections, the lr re-expression and the measured laws are in
    the module docstring of :mod:`samplers_as_optim.sgmcmc.adamw_sghmc`.

    {arguments}

    {example}

    References:
        Chen, T., Fox, E. & Guestrin, C. (2014). Stochastic gradient Hamiltonian Monte
        Carlo. ICML. Eq. (9). Ma, Y.-A., Chen, T. & Fox, E. (2015). A complete recipe
        for stochastic gradient MCMC. NeurIPS. Eq. (3). Loshchilov, I. & Hutter, F.
        (2019). Decoupled weight decay regularization. ICLR. Algorithm 2. Shazeer, N. &
        Stern, M. (2018). Adafactor. ICML. Eq. (4)-(5).
    """,
    transform_doc=r"""SGHMC preconditioned by Adam's second moment as a torchopt transformation.

    The same chain as :class:`AdamWSGHMC`, computed by the same kernel: each update is
    :math:`u = -lr\,d` with

    .. math::

        d = \lambda\theta + m/a, \qquad
        m \leftarrow \beta_1 m + (1-\beta_1)\big(g' + \sqrt{{2T/(N\,lr)}}\,\sqrt{{a}}\,
        \xi\big),

    to be added to the parameters (``torchopt.apply_updates``). At temperature 0 it is
    AdamW's update up to rounding (``torch.optim.AdamW`` fuses its last operations).

    {arguments}

    {example}

    References:
        Chen, T., Fox, E. & Guestrin, C. (2014). Stochastic gradient Hamiltonian Monte
        Carlo. ICML. Loshchilov, I. & Hutter, F. (2019). Decoupled weight decay
        regularization. ICLR.
    """,
)


class AdamWSGHMC(SamplerOptimizer, definition=DEFINITION):
    """SGHMC preconditioned by Adam's second moment, a drop-in for ``torch.optim.AdamW``."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        r"""The base class's; then a warning where a group's prior depends on the data.

        A decoupled ``weight_decay`` at temperature > 0 samples the prior
        :math:`\mathcal N(0, 1/(N\lambda a))` (module docstring). Said once, as the
        group is added (the constructor adds each), not when it is re-checked.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        temperature = float(group["temperature"])
        if temperature > 0 and group["weight_decay"] > 0 and not group.get("l2_prior"):
            warnings.warn(
                f"AdamWSGHMC's weight_decay {group['weight_decay']!r} at temperature "
                f"{temperature!r} is AdamW's decoupled decay: the prior it samples, "
                "N(0, 1/(N weight_decay a)), depends on the data through the preconditioner "
                "a. For a stated prior give AdamWSGHMC prior_param_groups(model, num_data=N, "
                "decoupled=True) and add prior_loss(model, num_data=N) to the loss (or put "
                "your own prior in the loss with weight_decay=0).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
