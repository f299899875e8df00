"""Every registered sampler's front ends against its one definition.

``samplers_as_optim.sgmcmc.SAMPLERS`` lists the SG-MCMC samplers; each is built from a
``SamplerDefinition`` (``docs/design.md``). These tests hold for every entry, so a new
sampler is checked as soon as it is registered: its signatures and docs are the declared
ones, both front ends refuse every declared hyperparameter's bad value naming it, the
transformation's state is the declared one and loads under ``weights_only=True``, and the
two front ends take the same steps. A toy sampler declared here shows what a definition
needs and that the machinery builds a working pair from it.
"""

from __future__ import annotations

import inspect
import io
import math
import pydoc
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torchopt

from samplers_as_optim import transforms
from samplers_as_optim.sgmcmc import SAMPLERS
from samplers_as_optim.sgmcmc.definition import (
    REQUIRED,
    Hyperparameter,
    SamplerDefinition,
    StateField,
    UpdateInput,
    UpdateOutput,
)
from samplers_as_optim.sgmcmc.definition.arguments import sgd_signature
from samplers_as_optim.sgmcmc.optimizer import SamplerOptimizer
from samplers_as_optim.sgmcmc.transform import transformation_of

NAMES = [cls.__name__ for cls in SAMPLERS]


def factory(cls: type[SamplerOptimizer]) -> Any:
    return getattr(transforms, cls.definition.transform_name)


@pytest.mark.parametrize("cls", SAMPLERS, ids=NAMES)
def test_the_optimizer_signature_is_the_declared_one(cls):
    definition = cls.definition
    parameters = inspect.signature(cls).parameters
    assert list(parameters) == ["params", *(h.name for h in definition.hyperparameters)]
    for h in definition.hyperparameters:
        parameter = parameters[h.name]
        assert parameter.annotation == h.annotation
        expected = inspect.Parameter.empty if h.default is REQUIRED else h.default
        assert parameter.default == expected
        kind = parameter.POSITIONAL_OR_KEYWORD if h.positional else parameter.KEYWORD_ONLY
        assert parameter.kind == kind, h.name
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert f"{cls.__name__}(params: 'Any', lr: 'float | Tensor'" in text


@pytest.mark.parametrize("cls", SAMPLERS, ids=NAMES)
def test_the_transformation_signature_is_the_declared_one(cls):
    definition = cls.definition
    parameters = inspect.signature(factory(cls)).parameters
    declared = {h.name: h for h in definition.hyperparameters if h.transform}
    assert set(parameters) == set(declared)
    assert parameters["lr"].default is inspect.Parameter.empty  # a transform needs lr
    assert parameters["lr"].annotation == "ScalarOrSchedule"
    assert parameters["num_data"].kind == inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("cls", SAMPLERS, ids=NAMES)
@pytest.mark.parametrize("front", ["optimizer", "transformation"])
def test_every_argument_is_documented_in_order(cls, front):
    if front == "optimizer":
        doc, names = cls.__doc__, ["params", *inspect.signature(cls).parameters][1:]
        names = ["params", *names]
    else:
        doc, names = factory(cls).__doc__, list(inspect.signature(factory(cls)).parameters)
    args = doc[doc.index("    Args:\n") :]
    positions = [args.find(f"\n        {name}: ") for name in names]
    assert -1 not in positions, [n for n, p in zip(names, positions, strict=True) if p < 0]
    assert positions == sorted(positions)
    if front == "transformation":
        assert "\n    Returns:\n        A ``torchopt.base.GradientTransformation``" in doc
    else:
        assert (
            f"\n    Example:\n        >>> import torch\n        >>> from samplers_as_optim import {cls.__name__}"
            in doc
        )


@pytest.mark.parametrize("cls", SAMPLERS, ids=NAMES)
@pytest.mark.parametrize("front", ["optimizer", "transformation"])
def test_each_declared_check_refuses_a_bad_value_naming_it(cls, front):
    checked = [h for h in cls.definition.hyperparameters if h.check is not None]
    assert checked  # every sampler declares at least one argument of its own
    for h in checked:
        if front == "transformation" and not h.transform:
            continue
        with pytest.raises((TypeError, ValueError), match=h.name):
            if front == "optimizer":
                cls([torch.zeros(2, requires_grad=True)], num_data=10, **{h.name: "bad"})
            else:
                factory(cls)(0.1, num_data=10, **{h.name: "bad"})


@pytest.mark.parametrize("cls", SAMPLERS, ids=NAMES)
def test_the_transformation_state_is_the_declared_one_and_loads_safely(cls):
    definition = cls.definition
    state_type = getattr(transforms, f"{definition.name}State")
    assert state_type.__module__ == "samplers_as_optim.transforms"
    expected = [field.name for field in definition.state]
    if definition.momentum_in_lr_units:
        expected.append("momentum_lr")
    assert list(state_type._fields) == [*expected, "seed", "count"]
    for field in definition.state:
        assert field.name in state_type.__doc__
    tx = factory(cls)(0.1, num_data=10, seed=3)
    state = tx.init([torch.ones(2)])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True, torch's default
    assert type(loaded) is state_type
    assert loaded.seed == 3 and loaded.count == 0


@pytest.mark.parametrize("cls", SAMPLERS, ids=NAMES)
def test_both_front_ends_take_the_same_steps(cls):
    """One seed, one param group, the declared defaults: the same chain bit for bit."""
    torch.manual_seed(0)
    start = [torch.randn(3, 2), torch.randn(4)]
    params = [p.clone().requires_grad_() for p in start]
    opt = cls(params, lr=0.01, num_data=50, seed=7)
    tx = factory(cls)(0.01, num_data=50, seed=7)
    leaves = [p.clone() for p in start]
    state = tx.init(leaves)
    for step in range(4):
        grads = [p.detach() * (step + 1) - 0.5 for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        updates, state = tx.update([g.clone() for g in grads], state, params=leaves)
        leaves = torchopt.apply_updates(leaves, updates)
    for p, leaf in zip(params, leaves, strict=True):
        assert torch.equal(p.detach(), leaf)


# ---------------------------------------------------------------------- a toy sampler


def _toy_update(
    group: Mapping[str, Any], inputs: UpdateInput, *, foreach: bool, inplace: bool
) -> UpdateOutput:
    """SGLD preconditioned by a constant ``scale`` (drift and noise variance)."""
    scale, noise = group["scale"], inputs.noise
    counts = [c if inplace or c is None else c.clone() for c in inputs.buffers["steps"]]
    directions = []
    for i, grad in enumerate(inputs.grads):
        direction = grad.mul(scale)
        if noise is not None:
            c = math.sqrt(2 * group["temperature"] * scale / (group["num_data"] * group["lr"]))
            direction = direction.sub(noise[i], alpha=c)
        directions.append(direction)
        counts[i] = (counts[i] if counts[i] is not None else torch.zeros(())).add(1)
    return directions, {"steps": counts}


TOY = SamplerDefinition(
    name="ToyLangevin",
    transform_name="toy",
    hyperparameters=sgd_signature(
        Hyperparameter("momentum", 0.0, doc="momentum: must be 0.", positional=True),
        Hyperparameter(
            "scale",
            default=1.0,
            doc="scale: the preconditioner, a number > 0.",
            check=lambda value, where: _check_scale(value, where),
        ),
    ),
    state=(
        StateField(
            "steps",
            "the steps taken, per leaf.",
            init=lambda param, group: torch.zeros((), dtype=param.dtype),
        ),
    ),
    update=_toy_update,
    check=lambda group, temperature, where: None,
    optimizer_doc="A toy sampler.\n\n    {arguments}\n",
    transform_doc="A toy sampler.\n\n    {arguments}\n",
)


def _check_scale(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"Invalid scale{where}: {value!r} (expected a number > 0)")


class ToyLangevin(SamplerOptimizer, definition=TOY):
    """A toy sampler built from ``TOY``."""


toy, ToyState = transformation_of(TOY, ToyLangevin)


def test_a_toy_definition_builds_a_working_pair():
    assert list(inspect.signature(ToyLangevin).parameters)[-1] == "scale"
    assert "scale: the preconditioner" in ToyLangevin.__doc__
    with pytest.raises(ValueError, match="Invalid scale: -1"):
        ToyLangevin([torch.zeros(1, requires_grad=True)], num_data=1, scale=-1)
    with pytest.raises(ValueError, match="Invalid scale: 0"):
        toy(0.1, num_data=1, scale=0)
    # at temperature 0 with scale 1 it is SGD
    p = torch.ones(3, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    opt, sgd = ToyLangevin([p], lr=0.1, num_data=10, temperature=0.0), torch.optim.SGD([q], lr=0.1)
    for _ in range(3):
        p.grad, q.grad = p.detach() * 2, q.detach() * 2
        opt.step()
        sgd.step()
    assert torch.equal(p, q)
    assert opt.state[p]["steps"] == 3
    # the transformation and the optimizer take the same noisy steps
    p = torch.ones(3, requires_grad=True)
    opt = ToyLangevin([p], lr=0.1, num_data=10, scale=0.5, seed=1)
    tx = toy(0.1, num_data=10, scale=0.5, seed=1)
    leaves, state = [torch.ones(3)], tx.init([torch.ones(3)])
    for _ in range(3):
        p.grad = p.detach().clone()
        opt.step()
        updates, state = tx.update([leaves[0].clone()], state, params=leaves)
        leaves = torchopt.apply_updates(leaves, updates)
    assert torch.equal(p.detach(), leaves[0])
    assert state.count == 3 and list(state.steps) == [torch.tensor(3.0)]


def test_a_class_without_a_definition_cannot_be_built():
    class Bare(SamplerOptimizer):
        pass

    with pytest.raises(TypeError, match="Bare has no sampler definition"):
        Bare([torch.zeros(1)])


@pytest.mark.parametrize("name", ["seed", "count", "noise_key", "momentum_lr"])
def test_a_state_field_may_not_take_a_name_the_front_ends_keep(name):
    with pytest.raises(ValueError, match=f"Invalid state of Bad: \\['{name}'\\]"):
        SamplerDefinition(**{**TOY.__dict__, "name": "Bad", "state": (StateField(name, ""),)})


def test_hyperparameter_names_are_unique():
    twice = (*TOY.hyperparameters, TOY.hyperparameters[-1])
    with pytest.raises(ValueError, match="Invalid hyperparameters of Bad: \\['scale'\\]"):
        SamplerDefinition(**{**TOY.__dict__, "name": "Bad", "hyperparameters": twice})
