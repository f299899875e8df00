"""The stacked layout and call_stacked, the package's one vmapped forward.

Checks that entry i of call_stacked is the module run with entry i's tensors (to rounding:
vmap runs a batched matmul where the module runs its own, and the two kernels may round
differently in the last bit for some shapes), that names absent from the dict
keep the module's values, that chunking changes neither results nor gradients while it
bounds activation memory (measured with torch's profiler), that tied weights, pytree
inputs, kwargs, dropout modes and in-place buffer updates behave, that the module is left
as it was (also when its forward raises), and every error message.
"""

import pytest
import torch
from kernel_equality import assert_same_up_to_kernels
from peak_memory import peak_tensor_bytes
from torch import nn
from torch.func import functional_call
from torch.testing import assert_close

from samplers_as_optim.samples.stacked import (
    call_stacked,
    num_stacked,
    stack_modules,
    stack_states,
    unstack,
)


def mlp(width: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, width), nn.ReLU(), nn.Linear(width, 3))


@pytest.fixture
def members(device):
    torch.manual_seed(0)
    return [mlp().to(device) for _ in range(6)]


def test_each_entry_is_the_module_with_that_entrys_tensors(members, device):
    stacked = stack_modules(members)
    x = torch.randn(7, 5, device=device)
    out = call_stacked(members[0], stacked, x)
    assert out.shape == (6, 7, 3)
    for i, member in enumerate(members):
        assert_close(out[i], member(x))


def test_per_sample_inputs_give_each_entry_its_slice(members, device):
    stacked = stack_modules(members)
    x = torch.randn(6, 7, 5, device=device)
    out = call_stacked(members[0], stacked, x, per_sample_inputs=True)
    for i, member in enumerate(members):
        assert_close(out[i], member(x[i]))


def test_names_absent_from_the_dict_keep_the_modules_values(members, device):
    weights = torch.randn(4, 16, 5, device=device)
    x = torch.randn(3, 5, device=device)
    module = members[0]
    out = call_stacked(module, {"0.weight": weights}, x)
    for i in range(4):
        expected = functional_call(module, {"0.weight": weights[i]}, (x,))
        assert_close(out[i], expected)


def test_gradients_flow_into_the_stacked_tensors(members, device):
    stacked = {k: v.requires_grad_() for k, v in stack_modules(members).items()}
    x = torch.randn(7, 5, device=device)
    call_stacked(members[0], stacked, x).pow(2).sum().backward()
    for i, member in enumerate(members):
        member.zero_grad()
        member(x).pow(2).sum().backward()
        for name, param in member.named_parameters():
            assert_close(stacked[name].grad[i], param.grad)


@pytest.mark.parametrize("chunk_size", [1, 4, 6, 100])
def test_chunking_gives_identical_outputs_and_gradients(members, device, chunk_size):
    x = torch.randn(6, 7, 5, device=device)
    results = []
    for size in (None, chunk_size):
        stacked = {k: v.requires_grad_() for k, v in stack_modules(members).items()}
        out = call_stacked(members[0], stacked, x, per_sample_inputs=True, chunk_size=size)
        out.sum().backward()
        results.append((out.detach(), {k: v.grad for k, v in stacked.items()}))
    (out_full, grads_full), (out_chunked, grads_chunked) = results
    assert_same_up_to_kernels(out_full, out_chunked)
    for name in grads_full:
        assert_same_up_to_kernels(grads_full[name], grads_chunked[name])


def test_chunking_bounds_activation_memory():
    torch.manual_seed(0)
    wide = [nn.Sequential(nn.Linear(4, 256), nn.Tanh(), nn.Linear(256, 1)) for _ in range(16)]
    stacked = stack_modules(wide)
    x = torch.randn(128, 4)
    activation = 128 * 256 * 4  # bytes of one entry's hidden layer
    with torch.no_grad():
        full = peak_tensor_bytes(lambda: call_stacked(wide[0], stacked, x))
        chunked = peak_tensor_bytes(lambda: call_stacked(wide[0], stacked, x, chunk_size=2))
    # all 16 entries' hidden layers at once (pre- and post-activation: 2 x 16) vs those
    # of one chunk of 2 entries (2 x 2) plus the small output
    assert full >= 32 * activation
    assert chunked <= 4.5 * activation


def test_tied_weights_follow_their_tensor(device):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.encode = nn.Linear(4, 4, bias=False)
            self.decode = nn.Linear(4, 4, bias=False)
            self.decode.weight = self.encode.weight

        def forward(self, x):
            return self.decode(self.encode(x).tanh())

    torch.manual_seed(0)
    model = Tied().to(device)
    assert [name for name, _ in model.named_parameters()] == ["encode.weight"]
    weights = torch.randn(3, 4, 4, device=device)
    x = torch.randn(2, 4, device=device)
    out = call_stacked(model, {"encode.weight": weights}, x)
    for i in range(3):
        expected = (x @ weights[i].T).tanh() @ weights[i].T
        assert torch.allclose(out[i], expected, atol=1e-6)
    # through the alias too
    assert_close(call_stacked(model, {"decode.weight": weights}, x), out)
    with pytest.raises(ValueError, match=r"names 'encode.weight' and 'decode.weight' are the"):
        call_stacked(model, {"encode.weight": weights, "decode.weight": weights}, x)


def test_pytree_inputs_and_shared_kwargs(device):
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 2)

        def forward(self, pair, *, scale):
            first, second = pair
            return self.linear(first + second) * scale

    torch.manual_seed(0)
    models = [TwoInputs().to(device) for _ in range(4)]
    stacked = stack_modules(models)
    a, b = torch.randn(4, 5, 3, device=device), torch.randn(4, 5, 3, device=device)
    out = call_stacked(models[0], stacked, (a, b), per_sample_inputs=True, scale=2.0)
    for i, model in enumerate(models):
        assert_close(out[i], model((a[i], b[i]), scale=2.0))


def test_dropout_masks_differ_per_entry_unless_randomness_is_same(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5)).to(device).train()
    stacked = stack_modules([model] * 4)  # identical entries
    x = torch.randn(3, 8, device=device)
    different = call_stacked(model, stacked, x)
    same = call_stacked(model, stacked, x, randomness="same")
    assert not torch.equal(different[0], different[1])
    assert all(torch.equal(same[0], same[i]) for i in range(4))
    model.eval()
    evaluated = call_stacked(model, stacked, x)
    assert torch.equal(evaluated[0], evaluated[3])


def test_stacked_buffers_are_updated_per_entry_in_train_mode(device):
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(device) for _ in range(3)]
    stacked = stack_modules(models, buffers=True)
    x = torch.randn(3, 10, 3, device=device)
    call_stacked(models[0], stacked, x, per_sample_inputs=True, chunk_size=2)
    for i, model in enumerate(models):
        model(x[i])
        assert torch.allclose(stacked["1.running_mean"][i], model[1].running_mean)
        assert torch.allclose(stacked["1.running_var"][i], model[1].running_var)
        assert stacked["1.num_batches_tracked"][i] == 1


def test_the_module_is_restored_even_when_its_forward_raises(members, device):
    module = members[0]
    before = {name: (id(t), t.clone()) for name, t in module.named_parameters()}
    stacked = stack_modules(members)
    call_stacked(module, stacked, torch.randn(2, 5, device=device))
    with pytest.raises(RuntimeError):
        call_stacked(module, stacked, torch.randn(2, 4, device=device))  # wrong width
    for name, tensor in module.named_parameters():
        assert id(tensor) == before[name][0] and torch.equal(tensor, before[name][1])
        assert isinstance(tensor, nn.Parameter)


def test_helpers():
    stacked = {"w": torch.arange(6.0).reshape(3, 2), "b": torch.zeros(3)}
    assert num_stacked(stacked) == 3
    assert torch.equal(unstack(stacked, -1)["w"], torch.tensor([4.0, 5.0]))
    states = stack_states([{"w": torch.ones(2)}, {"w": torch.zeros(2)}])
    assert states["w"].shape == (2, 2) and not states["w"].requires_grad


def test_error_messages(members, device):
    module = members[0]
    stacked = stack_modules(members)
    x = torch.randn(2, 5, device=device)
    with pytest.raises(ValueError, match=r"Invalid stacked parameters: \{\} \(expected at least"):
        num_stacked({})
    with pytest.raises(ValueError, match=r"Invalid stacked parameters: leading sizes"):
        num_stacked({"a": torch.zeros(2, 3), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"Invalid stacked parameters: leading sizes"):
        num_stacked({"a": torch.tensor(1.0)})
    with pytest.raises(ValueError, match=r"Invalid states: \[\] \(expected at least one"):
        stack_states([])
    with pytest.raises(ValueError, match=r"Invalid states: entry 1 has keys \['v'\]"):
        stack_states([{"w": torch.ones(1)}, {"v": torch.ones(1)}])
    with pytest.raises(IndexError, match=r"Invalid index: 6 \(expected an integer in \[-6, 6\)\)"):
        unstack(stacked, 6)
    with pytest.raises(IndexError, match=r"Invalid index: True \(expected an integer"):
        unstack(stacked, True)
    with pytest.raises(TypeError, match=r"Invalid module: 'net' \(expected an nn.Module\)"):
        call_stacked("net", stacked, x)
    with pytest.raises(KeyError, match=r"names \['nope'\] are not parameters or buffers"):
        call_stacked(module, {"nope": torch.zeros(6, 1)}, x)
    with pytest.raises(ValueError, match=r"Invalid input 0: shape \(2, 5\) \(expected a leading"):
        call_stacked(module, stacked, x, per_sample_inputs=True)
    for bad, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)):
        message = rf"Invalid chunk_size: {bad!r} \(expected None or an integer >= 1\)"
        with pytest.raises(error, match=message):
            call_stacked(module, stacked, x, chunk_size=bad)
    with pytest.raises(ValueError, match=r"Invalid randomness: 'sometimes' \(expected one of"):
        call_stacked(module, stacked, x, randomness="sometimes")
    with pytest.raises(TypeError, match=r"Invalid per_sample_inputs: 1 \(expected True or"):
        call_stacked(module, stacked, x, per_sample_inputs=1)


def test_an_entry_without_its_sample_dimension_is_an_error_naming_it():
    model = torch.nn.Linear(4, 3)
    with pytest.raises(
        ValueError,
        match=r"Invalid stacked parameters: 'weight' has shape \(3, 4\), the shape of the "
        r"module's own tensor, so it was read as 3 samples of shape \(4,\) and the model "
        r"failed \(expected \[S, 3, 4\]: add the sample dimension",
    ):
        call_stacked(model, {"weight": torch.randn(3, 4)}, torch.randn(2, 4))


def test_samples_of_another_model_are_refused_naming_the_parameter(members, device):
    module = members[0]  # Linear(5, 16), ReLU, Linear(16, 3)
    before = {name: (id(t), t.clone()) for name, t in module.named_parameters()}
    x = torch.randn(2, 5, device=device)
    torch.manual_seed(1)
    other = [mlp(width=8).to(device) for _ in range(4)]
    # one name: today torch's "mat1 and mat2 shapes cannot be multiplied"
    with pytest.raises(
        ValueError,
        match=r"Invalid stacked parameters: '0.weight' has shape \(4, 8, 5\) \(expected "
        r"\[S, 16, 5\]: S samples of Sequential's '0.weight', of shape \(16, 5\)\)$",
    ):
        call_stacked(module, {"0.weight": stack_modules(other)["0.weight"]}, x)
    # every name: today a silent run of the other architecture
    with pytest.raises(
        ValueError,
        match=r"Invalid stacked parameters: '0.weight' has shape \(4, 8, 5\) \(expected "
        r"\[S, 16, 5\]: S samples of Sequential's '0.weight', of shape \(16, 5\); also "
        r"mismatched: '0.bias', '2.weight'\)$",
    ):
        call_stacked(module, stack_modules(other), x)
    with pytest.raises(
        ValueError, match=r"'0.bias' has shape \(4, 8\) \(expected \[S, 16\]: S samples"
    ):
        call_stacked(module, {"0.bias": torch.zeros(4, 8, device=device)}, x)
    with pytest.raises(ValueError, match=r"'2.bias' has shape \(4, 3, 1\) \(expected \[S, 3\]"):
        call_stacked(module, {"2.bias": torch.zeros(4, 3, 1, device=device)}, x)
    for name, tensor in module.named_parameters():  # a refused call changes nothing
        assert id(tensor) == before[name][0] and torch.equal(tensor, before[name][1])
    narrow = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3))).to(device)
    wide = [nn.Sequential(*(nn.Linear(6, 6) for _ in range(3))).to(device) for _ in "ab"]
    with pytest.raises(
        ValueError,
        match=r"'0.weight' has shape \(2, 6, 6\) \(expected \[S, 4, 4\]: S samples of "
        r"Sequential's '0.weight', of shape \(4, 4\); also mismatched: '0.bias', "
        r"'1.weight' and 3 more\)$",
    ):
        call_stacked(narrow, stack_modules(wide), torch.randn(2, 4, device=device))


def test_the_shape_check_keeps_subsets_buffers_and_a_stacked_module(device):
    """What the check must not refuse: a subset of names, stacked buffers (0-d ones
    included), and a ``ParallelEnsemble``'s module with its own stacked tensors."""
    from samplers_as_optim import ParallelEnsemble

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(device).eval() for _ in "ab"]
    x = torch.randn(5, 3, device=device)
    out = call_stacked(models[0], stack_modules(models), x)
    assert_close(out[1], models[1](x))
    assert call_stacked(models[0], {"0.bias": torch.zeros(2, 4, device=device)}, x).shape == (
        2,
        5,
        4,
    )
    ensemble = ParallelEnsemble(mlp(), 3, seed=0).to(device)
    x = torch.randn(2, 5, device=device)
    assert_close(call_stacked(ensemble.module, ensemble.stacked(), x), ensemble(x))
