"""Each sampler's temperature rule (``sgmcmc/temperature/rule``): part of its definition.

What a sampler means by its kinetic and configurational temperatures is the
``TemperatureRule`` its definition holds, read through the object by
``temperature/estimates`` (no switch on the sampler's name); the estimates themselves are
``test_chain_temperature.py``'s.
"""

import pytest
import torch

import samplers_as_optim as sao
from samplers_as_optim.sgmcmc.temperature.estimates import group_sums
from samplers_as_optim.sgmcmc.temperature.rule import (
    LANGEVIN,
    TemperatureRule,
    UnitMass,
    midpoint_factor,
    thermostat_kinetic,
)

SAMPLERS = [sao.SGLD, sao.PSGLD, sao.SGHMC, sao.SGNHT, sao.BAOA, sao.AdamWSGHMC]


@pytest.mark.parametrize("cls", SAMPLERS, ids=lambda cls: cls.__name__)
def test_every_sampler_declares_its_rule_as_an_object(cls):
    """A momentum sampler's rule reads the buffer its definition keeps in SGD units."""
    definition = cls.definition
    rule = definition.temperature_rule
    assert isinstance(rule, TemperatureRule)
    if rule.kinetic is None:
        assert rule == LANGEVIN and cls in (sao.SGLD, sao.PSGLD)
    else:
        assert definition.momentum_in_lr_units
        assert rule.momentum_buffer == definition.momentum_buffer


def test_the_rules_say_what_each_sampler_means():
    """Mass, discrete factor and prior, as the samplers' docstrings derive them."""
    rules = {cls.__name__: cls.definition.temperature_rule for cls in SAMPLERS}
    assert rules["SGHMC"].kinetic == UnitMass(midpoint_factor)
    assert rules["BAOA"].kinetic == UnitMass()
    assert rules["SGNHT"].kinetic is thermostat_kinetic
    assert rules["AdamWSGHMC"].decay_scale is not None
    assert [name for name, rule in rules.items() if rule.decay_scale is not None] == ["AdamWSGHMC"]
    assert [name for name, rule in rules.items() if rule.plain] == ["SGHMC", "BAOA"]
    assert midpoint_factor({"momentum": 0.8}) == 0.9


def test_a_rule_built_from_the_pieces_is_what_the_estimates_read():
    """The estimates follow the object: SGHMC's buffers read with BAOA's unit factor give
    its kinetic sum divided by SGHMC's midpoint factor, stacked or not."""
    torch.manual_seed(0)
    plain = torch.nn.Parameter(torch.randn(50))
    optimizer = sao.SGHMC([plain], lr=1e-2, momentum=0.6, num_data=100, seed=0)
    for _ in range(3):
        optimizer.zero_grad()
        (plain**2).sum().backward()
        optimizer.step()
    group = optimizer.param_groups[0]
    sghmc = group_sums(optimizer.definition.temperature_rule, group, 0, optimizer.state)
    unit = group_sums(TemperatureRule("unit", kinetic=UnitMass()), group, 0, optimizer.state)
    assert sghmc.kinetic is not None and unit.kinetic is not None
    torch.testing.assert_close(unit.kinetic * 0.8, sghmc.kinetic, rtol=1e-12, atol=0.0)
    none = group_sums(LANGEVIN, group, 0, optimizer.state)
    assert none.kinetic is None and none.kinetic_dof == 0
    torch.testing.assert_close(none.conf, sghmc.conf, rtol=0.0, atol=0.0)
