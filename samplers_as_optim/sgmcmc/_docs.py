"""Docstring fragments for arguments every sampler shares (as torch does with ``_maximize_doc``).

Each fragment is one Google-style ``Args`` entry, indented for a class docstring.
"""

from __future__ import annotations

params_doc = r"""params: iterable of parameters or of dicts defining param groups, as for
            ``torch.optim.SGD``. Any hyperparameter below may be set per group."""

lr_doc = r"""lr: learning rate, in the units of ``torch.optim.SGD`` (default: 1e-3; a finite
            number >= 0, or a one-element tensor). At temperature > 0 it is also the
            sampler's step size (see the update above); a group whose ``lr`` is 0 at
            temperature > 0 is left unchanged by a step (no time passes)."""

num_data_doc = r"""num_data: the number of training examples N (required, a positive
            integer). The loss is the usual mean over a minibatch; N turns it into the
            log posterior ``-N * loss``."""

temperature_doc = r"""temperature: T, the target is ``p(theta | D) ** (1 / T)`` (default:
            1.0, the Bayesian posterior; a finite number >= 0). Lives in each param group,
            so a schedule can change it."""

weight_decay_doc = r"""weight_decay: L2 penalty added to the gradient as in
            ``torch.optim.SGD`` (default: 0; a finite number >= 0). A Gaussian prior
            N(0, s**2) on every weight is ``weight_decay = 1 / (num_data * s**2)``."""

dampening_doc = r"""dampening: as in ``torch.optim.SGD`` (default: 0). Has no sampling meaning:
            a value other than 0 requires temperature 0."""

nesterov_doc = r"""nesterov: as in ``torch.optim.SGD`` (default: False). Has no sampling
            meaning: True requires temperature 0."""

maximize_doc = r"""maximize: follow the gradient instead of its negative, as in
            ``torch.optim.SGD`` (default: False). The target is then
            ``exp(N * objective / T)``."""

foreach_doc = r"""foreach: use the multi-tensor (foreach) kernel (default: None: foreach when
            every parameter is on an accelerator, as torch.optim does). Both paths give
            the same numbers."""

differentiable_doc = r"""differentiable: accepted for compatibility with ``torch.optim.SGD``;
            only False is supported."""

fused_doc = r"""fused: accepted for compatibility with ``torch.optim.SGD``; only None or
            False is supported (use ``foreach``)."""

seed_doc = r"""seed: seed of the chain's noise (default: None: drawn from torch's global RNG
            at construction, so ``torch.manual_seed`` governs a run; an integer in
            [0, 2**64)). The same seed on every data-parallel rank keeps replicas in sync."""

overlap_noise_doc = r"""overlap_noise: draw the next step's noise right after each step, so
            that it overlaps the forward and backward passes (default: True): on a worker
            thread for CPU parameters, on a side stream for CUDA parameters. The numbers
            are the same either way; it costs one parameter-sized buffer for each
            parameter of at least 2**16 elements at temperature > 0 (smaller ones draw in
            the step). Off under ``torch.compile``, which draws in the graph."""

nonfinite_doc = r"""nonfinite: what a step does when a gradient holds NaN or infinity
            (default: ``"raise"``): ``"raise"`` refuses the step with a
            ``FloatingPointError`` naming the parameter, before anything changes (this
            reads one value back from the device: a host synchronisation, and a graph
            break under ``torch.compile``); ``"skip"`` makes that step a no-op (parameters
            and state keep their values, the step counter advances) and counts it in
            ``param_group["skipped_steps"]`` (a 0-d integer tensor), without any
            synchronisation, so ``torch.compile(opt.step)`` is one graph."""
