r"""The arguments every SG-MCMC sampler shares, each declared once.

Each is a :class:`~.definition.Hyperparameter`: default, type, where it goes in the
signature and its ``Args`` entry (one Google-style entry, continuation lines indented for
a class docstring, as torch writes ``_maximize_doc``). A sampler's definition lists them in
its signature's order, with its own arguments between (:func:`sgd_signature` for the
samplers whose signature is ``torch.optim.SGD``'s). The Optimizer base class validates
them (``SamplerOptimizer.check_hyperparameters``, or its constructor for the options
that are not kept in the param groups), so they declare no ``check``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.validation import check_bool, check_finite
from . import REQUIRED, Hyperparameter

__all__ = [
    "CAPTURABLE",
    "DAMPENING",
    "DIFFERENTIABLE",
    "FOREACH",
    "FUSED",
    "LR",
    "MAXIMIZE",
    "NESTEROV",
    "NONFINITE",
    "NONFINITE_POLICIES",
    "NUM_DATA",
    "OVERLAP_NOISE",
    "PARAMS_DOC",
    "RETURNS_DOC",
    "SEED",
    "TEMPERATURE",
    "WEIGHT_DECAY",
    "check_differentiable",
    "pick",
    "sampling_meaningless",
    "sgd_signature",
]

#: the Optimizer's first argument (not a hyperparameter)
PARAMS_DOC = r"""params: iterable of parameters or of dicts defining param groups, as for
            ``torch.optim.SGD``. Any hyperparameter below may be set per group."""

#: what every transformation factory returns
RETURNS_DOC = r"""A ``torchopt.base.GradientTransformation``. ``update(updates, state, *,
        params=None, inplace=True)`` returns the updates to add to the parameters
        (``torchopt.apply_updates``) and the next state; ``params`` is required when
        ``weight_decay`` > 0. With ``inplace=True`` the updates are written into the
        given tensors and the buffers are updated in place, as torchopt does; with
        ``inplace=False`` nothing passed in is modified."""

LR = Hyperparameter(
    "lr",
    default=1e-3,
    annotation="float | Tensor",
    doc=r"""lr: learning rate, in the units of ``torch.optim.SGD`` (default: 1e-3; a finite
            number >= 0, or a one-element tensor). At temperature > 0 it is also the
            sampler's step size (see the update above); a group whose ``lr`` is 0 at
            temperature > 0 is left unchanged by a step (no time passes).""",
    transform_doc=r"""lr: learning rate in the units of ``torch.optim.SGD``, or a schedule: a
            callable of the step count (a Python int from 0) returning it, as torchopt's
            ``ScalarOrSchedule`` (a finite number >= 0, or a one-element tensor, read as
            a number: no gradient flows to it). At temperature > 0 it is also the
            sampler's step size; an update whose ``lr`` is 0 at temperature > 0 is zero
            and leaves the buffers unchanged (no time passes).""",
    transform_default=REQUIRED,
    positional=True,
    transform_annotation="ScalarOrSchedule",
)

NUM_DATA = Hyperparameter(
    "num_data",
    default=REQUIRED,
    annotation="int",
    doc=r"""num_data: the number of training examples N (required, a positive
            integer). The loss is the usual mean over a minibatch; N turns it into the
            log posterior ``-N * loss``.""",
)

TEMPERATURE = Hyperparameter(
    "temperature",
    default=1.0,
    annotation="float",
    doc=r"""temperature: T, the target is ``p(theta | D) ** (1 / T)`` (default:
            1.0, the Bayesian posterior; a finite number >= 0). Lives in each param group,
            so a schedule can change it.""",
    transform_doc=r"""temperature: T, the target is ``p(theta | D) ** (1 / T)`` (default:
            1.0, the Bayesian posterior; a finite number >= 0), or a schedule of the
            step count like ``lr`` (to anneal, for instance).""",
    transform_annotation="ScalarOrSchedule",
)

WEIGHT_DECAY = Hyperparameter(
    "weight_decay",
    default=0.0,
    annotation="float",
    doc=r"""weight_decay: L2 penalty added to the gradient as in
            ``torch.optim.SGD`` (default: 0; a finite number >= 0). A Gaussian prior
            N(0, s**2) on every weight is ``weight_decay = 1 / (num_data * s**2)``.""",
)

DAMPENING = Hyperparameter(
    "dampening",
    default=0.0,
    annotation="float",
    doc=r"""dampening: as in ``torch.optim.SGD`` (default: 0). Has no sampling meaning:
            a value other than 0 requires temperature 0.""",
    check=lambda value, where: check_finite("dampening", value, where=where),
)

NESTEROV = Hyperparameter(
    "nesterov",
    default=False,
    annotation="bool",
    doc=r"""nesterov: as in ``torch.optim.SGD`` (default: False). Has no sampling
            meaning: True requires temperature 0.""",
    check=lambda value, where: check_bool("nesterov", value, where=where),
)

MAXIMIZE = Hyperparameter(
    "maximize",
    default=False,
    annotation="bool",
    doc=r"""maximize: follow the gradient instead of its negative, as in
            ``torch.optim.SGD`` (default: False). The target is then
            ``exp(N * objective / T)``.""",
)

FOREACH = Hyperparameter(
    "foreach",
    default=None,
    annotation="bool | None",
    doc=r"""foreach: use the multi-tensor (foreach) kernel (default: None: foreach when
            every parameter is on an accelerator, as torch.optim does). Both paths give
            the same numbers.""",
    transform_doc=r"""foreach: use the multi-tensor (foreach) kernel (default: None: foreach when
            every tensor is on an accelerator, as torch.optim does, except inside
            ``torch.func`` transforms, which have no batching rule for foreach ops). Both
            paths give the same numbers.""",
)

DIFFERENTIABLE = Hyperparameter(
    "differentiable",
    default=False,
    annotation="bool",
    doc=r"""differentiable: accepted for compatibility with ``torch.optim.SGD``;
            only False is supported.""",
    transform=False,
)

FUSED = Hyperparameter(
    "fused",
    default=None,
    annotation="bool | None",
    doc=r"""fused: take each step in one Triton kernel per tensor, as
            ``torch.optim.SGD(fused=True)`` does (default: None, unfused until the
            kernels have run on a GPU, then fused where it can run: every parameter on
            CUDA, Triton installed, a sampler with a fused kernel, no param group setting
            ``foreach``; True: fused, or a ``ValueError`` saying why not; False:
            never). The fused step draws its noise from another stream than the unfused
            one (Triton's Philox, still a pure function of the seed, step,
            parameter and element), and checks the gradients on the device: with
            ``nonfinite="raise"`` a non-finite gradient is reported at the next
            ``step()`` or ``state_dict()`` call, the refused step having changed
            nothing. At temperature 0 it is ``torch.optim.SGD(fused=True)``'s step.""",
    transform_doc=r"""fused: compute each update with the sampler's fused Triton kernel,
            one launch per tensor, as the Optimizer's ``fused`` (default: None, unfused
            until the kernels have run on a GPU, then fused where it can run: every update
            on CUDA, Triton installed, a sampler with a fused kernel, outside
            ``torch.func`` transforms and without a graph through the updates; True:
            fused, or a ``ValueError`` saying why not; False: never). Fused, the noise is
            the fused stream, the very numbers a fused Optimizer of the same seed draws,
            and the updates agree with the unfused ones up to rounding (the kernel rounds
            :math:`-lr\,d` once); non-finite updates are still refused before anything
            changes (a host synchronisation, as unfused).""",
)

SEED = Hyperparameter(
    "seed",
    default=None,
    annotation="int | None",
    doc=r"""seed: seed of the chain's noise (default: None: drawn from torch's global RNG
            at construction, so ``torch.manual_seed`` governs a run; an integer in
            [0, 2**64)). The same seed on every data-parallel rank keeps replicas in sync.""",
    transform_doc=r"""seed: seed of the chain's noise, kept in the state with the step counter
            (default: None: drawn from torch's global RNG when the transformation is
            built, so ``torch.manual_seed`` governs a run; an integer in [0, 2**64)).""",
)

OVERLAP_NOISE = Hyperparameter(
    "overlap_noise",
    default=True,
    annotation="bool",
    doc=r"""overlap_noise: draw the next step's noise right after each step, so
            that it overlaps the forward and backward passes (default: True): on a worker
            thread for CPU parameters, on a side stream for CUDA parameters. The numbers
            are the same either way; it costs one parameter-sized buffer for each
            parameter of at least 2**16 elements at temperature > 0 (smaller ones draw in
            the step). Off under ``torch.compile``, which draws in the graph.""",
    transform=False,
)

NONFINITE = Hyperparameter(
    "nonfinite",
    default="raise",
    annotation="str",
    doc=r"""nonfinite: what a step does when a gradient holds NaN or infinity
            (default: ``"raise"``): ``"raise"`` refuses the step with a
            ``FloatingPointError`` naming the parameter, before anything changes (this
            reads one value back from the device: a host synchronisation, and a graph
            break under ``torch.compile``); ``"skip"`` makes that step a no-op (parameters
            and state keep their values, the step counter advances) and counts it in
            ``param_group["skipped_steps"]`` (a 0-d integer tensor), without any
            synchronisation, so ``torch.compile(opt.step)`` is one graph. (PSGLD and
            AdamWSGHMC keep host step counts that a skipped step must not advance: off
            the CPU they read the step's verdict back at the next call, and their
            compiled step is not one graph.)""",
    transform=False,
)

CAPTURABLE = Hyperparameter(
    "capturable",
    default=False,
    annotation="bool",
    doc=r"""capturable: take a step that reads nothing back to the host and keeps
            nothing in Python that changes from step to step, so that
            ``torch.cuda.graph`` or ``torch.compile(mode="reduce-overhead")`` can
            capture it, and each replay continues the chain (default: False). The
            group's step counter ``param_group["step"]`` is then a 0-d int64 tensor on
            its parameters' device, advanced in place, and the noise is computed on the
            device from it (``core/counter_normal``: another stream than the default
            one, the same function of the seed, step, parameter and element on every
            device). Requires ``nonfinite="skip"`` and the unfused step (``fused`` None
            or False). ``lr`` and ``temperature`` are read when the step is captured:
            capture again after changing them. An option of the optimizer, as
            ``nonfinite``: not kept in the param groups (``torch.compile`` writes
            ``capturable=True`` into every group of an optimizer it traces).""",
    transform=False,
    kept=False,
)


#: what a step does with a non-finite gradient: refuse it (an error, after a host sync) or
#: skip it (a no-op, counted in ``group["skipped_steps"]``, without a sync)
NONFINITE_POLICIES = ("raise", "skip")


def check_differentiable(differentiable: Any) -> None:
    """Reject ``torch.optim.SGD``'s ``differentiable=True``: no sampler implements it."""
    if differentiable is not False:
        raise ValueError(
            f"Invalid differentiable: {differentiable!r} (expected False: differentiating "
            "through a sampler step is not supported)"
        )


def sgd_signature(
    momentum: Hyperparameter,
    *extra: Hyperparameter,
    temperature: Hyperparameter = TEMPERATURE,
    dampening: Hyperparameter = DAMPENING,
    nesterov: Hyperparameter = NESTEROV,
) -> tuple[Hyperparameter, ...]:
    """``torch.optim.SGD``'s signature with ``momentum``, then the samplers' own arguments.

    ``(params, lr, momentum, *, num_data, temperature, weight_decay, dampening, nesterov,
    maximize, foreach, differentiable, fused, seed, overlap_noise, nonfinite, capturable,
    *extra)``; a sampler may document ``temperature``, ``dampening`` and ``nesterov`` its own way.
    """
    return (
        LR,
        momentum,
        NUM_DATA,
        temperature,
        WEIGHT_DECAY,
        dampening,
        nesterov,
        MAXIMIZE,
        FOREACH,
        DIFFERENTIABLE,
        FUSED,
        SEED,
        OVERLAP_NOISE,
        NONFINITE,
        CAPTURABLE,
        *extra,
    )


def sampling_meaningless(
    name: str, value: Any, neutral: Any, temperature: float, where: str
) -> None:
    """Refuse, at temperature > 0, a ``torch.optim`` option that has no sampling meaning.

    (``dampening``, ``nesterov``: accepted at temperature 0, where the sampler is the
    optimizer whose signature it shares.)
    """
    if value != neutral and temperature > 0:
        raise ValueError(
            f"{name}={value!r}{where} requires temperature=0 (it has no sampling meaning)"
        )


def pick(group: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    """The entries ``keys`` of ``group``, to pass a kernel its hyperparameters by name."""
    return {key: group[key] for key in keys}
