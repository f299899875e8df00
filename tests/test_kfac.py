"""KFAC Laplace (structure="kron") against a brute-force KFAC, curvlinops and the dense GGN.

The brute force follows the definition (Martens & Grosse 2015, eq. 1-2; Grosse & Martens
2016 for convolutions, "expand"): for every example i, the layer's augmented input
a~_i = [a_i; 1] (a hook) and the Jacobian of the model output with respect to the layer's
output (one autograd call per output coordinate), then G = sum_i J_i^T H_i J_i (H_i the
explicit output Hessian, or grad grad^T for the empirical Fisher) and A = mean_i a~ a~^T;
for a convolution the positions t are summed in G and averaged with the examples in A.
The block precision is prior I + (N/n) G (x) A in row-major vec([W, b]). float64
throughout, so agreement is to round-off (1e-10 relative).
"""

import math
import os
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim import predictive
from samplers_as_optim.gaussian.kfac import KronPrecision
from samplers_as_optim.gaussian.laplace import Laplace
from samplers_as_optim.gaussian.likelihoods import make_likelihood
from samplers_as_optim.samples.stacked import call_stacked

pytestmark = pytest.mark.usefixtures("float64_default")


def assert_close(a, b, rtol=1e-10):
    scale = max(float(b.abs().max()), 1e-300)
    assert float((a - b).abs().max()) <= rtol * scale, float((a - b).abs().max()) / scale


def loader(x, y, batch_size=4):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def mlp(outputs=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, outputs))


def class_data(n=10, seed=1, classes=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def conv_net():
    torch.manual_seed(2)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, stride=2),
        nn.Tanh(),
        nn.Conv2d(3, 2, 2, bias=False),
        nn.Flatten(),
        nn.Linear(2 * 2 * 2, 3),
    )


def conv_data(n=5):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(n, 2, 6, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


# ----------------------------------------------------------------------- brute force
def output_hessian(likelihood, kind, f, target):
    f = f.detach().requires_grad_(True)

    def nll(z):
        return likelihood.nll(z.unsqueeze(0), target.unsqueeze(0)).sum()

    if kind == "ef":
        (g,) = torch.autograd.grad(nll(f), f)
        return torch.outer(g, g)
    return torch.autograd.functional.hessian(nll, f.detach())


def brute_force_factors(model, layer, x, y, likelihood, kind):
    """(G, A) of ``layer`` from per-example Jacobians, by the definition."""
    g_total, a_total, rows = 0.0, 0.0, 0
    for i in range(x.shape[0]):
        seen = {}

        def hook(module, args, out, seen=seen):
            seen["a"] = args[0].detach()
            seen["z"] = out
            return out

        handle = layer.register_forward_hook(hook)
        f = model(x[i : i + 1]).reshape(-1)
        handle.remove()
        z = seen["z"]
        jac = torch.stack(
            [torch.autograd.grad(f[o], z, retain_graph=True)[0][0] for o in range(f.numel())]
        )  # (O, *z.shape[1:])
        hess = output_hessian(likelihood, kind, f, y[i])
        if isinstance(layer, nn.Conv2d):
            jac = jac.reshape(f.numel(), z.shape[1], -1)  # (O, C, T)
            patches = F.unfold(
                seen["a"], layer.kernel_size, padding=layer.padding, stride=layer.stride
            )[0].T  # (T, in)
        else:
            jac = jac.reshape(f.numel(), z.shape[-1], 1)
            patches = seen["a"].reshape(1, -1)
        if layer.bias is not None:
            patches = torch.cat([patches, torch.ones(patches.shape[0], 1)], 1)
        for t in range(jac.shape[-1]):
            g_total = g_total + jac[:, :, t].T @ hess @ jac[:, :, t]
        a_total = a_total + patches.T @ patches
        rows += patches.shape[0]
    return g_total, a_total / rows


def block(precision: KronPrecision, names):
    """The dense precision restricted to the given parameters (in the treated order)."""
    dense = precision.dense()
    index = []
    offset = 0
    for name, size in zip(precision.treated.names, precision.treated.sizes, strict=True):
        if name in names:
            index.extend(range(offset, offset + size))
        offset += size
    index = torch.tensor(index)
    return dense[index][:, index]


def to_vec_w_tilde(matrix, out_features, in_features, bias):
    """Reorder a (weight, bias)-ordered dense block into row-major vec([W, b]) order."""
    order = []
    for o in range(out_features):
        order.extend(o * in_features + j for j in range(in_features))
        if bias:
            order.append(out_features * in_features + o)
    order = torch.tensor(order)
    return matrix[order][:, order]


# ----------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_linear_layers_match_brute_force_kfac(kind):
    model = mlp()
    x, y = class_data()
    num_data, prior = 25, 0.4
    la = Laplace(
        model,
        num_data=num_data,
        likelihood="classification",
        curvature=kind,
        structure="kron",
        prior_precision=prior,
    ).fit(loader(x, y))
    like = make_likelihood("classification", None)
    for index in (0, 2):
        layer = model[index]
        g, a = brute_force_factors(model, layer, x, y, like, kind)
        expected = prior * torch.eye(g.shape[0] * a.shape[0]) + num_data / x.shape[0] * torch.kron(
            g, a
        )
        names = (f"{index}.weight", f"{index}.bias")
        got = to_vec_w_tilde(
            block(la.precision, names), layer.out_features, layer.in_features, True
        )
        assert float(torch.kron(g, a).abs().max()) > 1e-2  # not vacuous
        assert_close(got, expected)
    # layers are independent blocks
    dense = la.precision.dense()
    assert torch.all(dense[:25, 25:] == 0) and torch.all(dense[25:, :25] == 0)


def test_conv_layers_match_brute_force_kfac_expand():
    model = conv_net()
    x, y = conv_data()
    la = Laplace(
        model, num_data=5, likelihood="classification", structure="kron", prior_precision=1.0
    ).fit(loader(x, y, batch_size=2))
    like = make_likelihood("classification", None)
    for index, names in ((0, ("0.weight", "0.bias")), (2, ("2.weight",))):
        layer = model[index]
        g, a = brute_force_factors(model, layer, x, y, like, "ggn")
        expected = torch.eye(g.shape[0] * a.shape[0]) + torch.kron(g, a)
        inputs = layer.weight[0].numel()
        got = to_vec_w_tilde(
            block(la.precision, names), layer.out_channels, inputs, layer.bias is not None
        )
        assert_close(got, expected)


def test_kfac_is_exact_for_one_example():
    """With one example the Kronecker product is exact: each layer's block of the dense
    GGN Laplace (classification MLP, a conv net) equals the KFAC block."""
    for model, (x, y) in ((mlp(), class_data(n=1)), (conv_net(), conv_data(n=1))):
        kwargs = {"num_data": 7, "likelihood": "classification", "prior_precision": 0.3}
        dense = Laplace(model, structure="dense", **kwargs).fit(loader(x, y))
        kron = Laplace(model, structure="kron", **kwargs).fit(loader(x, y))
        conv_positions = isinstance(model[0], nn.Conv2d)
        for prefix in ("0.", "2.") if not conv_positions else ("4.",):
            names = [n for n in kron.treated.names if n.startswith(prefix)]
            index = []
            offset = 0
            for name, size in zip(kron.treated.names, kron.treated.sizes, strict=True):
                if name in names:
                    index.extend(range(offset, offset + size))
                offset += size
            index = torch.tensor(index)
            assert_close(block(kron.precision, names), dense.precision[index][:, index])


def test_kfac_is_exact_for_a_linear_gaussian_layer():
    """One Linear layer, Gaussian likelihood: G = I / s^2 for every example, so KFAC is the
    dense GGN = the conjugate posterior precision, and the sampled law is exact."""
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(30, 3, generator=gen), torch.randn(30, 2, generator=gen)
    model = nn.Linear(3, 2)
    kwargs = {"num_data": 30, "likelihood": "regression", "noise_std": 0.5, "prior_precision": 2.0}
    dense = Laplace(model, structure="dense", **kwargs).fit(loader(x, y, batch_size=7))
    kron = Laplace(model, structure="kron", **kwargs).fit(loader(x, y, batch_size=7))
    assert_close(kron.precision.dense(), dense.precision)
    draws = {n: t for n, t in kron.mean.items()}
    draws = kron.sample(3, generator=torch.Generator().manual_seed(0))
    assert_close(kron.log_prob(draws), dense.log_prob(draws), rtol=1e-10)
    variances = torch.cat([v.reshape(-1) for v in kron.covariance.values()])
    assert_close(variances, torch.diagonal(dense.covariance))


def test_conv_layer_with_one_position_is_exact():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(2, 3, 4), nn.Flatten(), nn.Tanh(), nn.Linear(3, 2))
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(1, 2, 4, 4, generator=gen), torch.randint(0, 2, (1,), generator=gen)
    kwargs = {"num_data": 3, "likelihood": "classification", "prior_precision": 0.5}
    dense = Laplace(model, structure="dense", **kwargs).fit(loader(x, y))
    kron = Laplace(model, structure="kron", **kwargs).fit(loader(x, y))
    assert_close(block(kron.precision, ("0.weight", "0.bias")), dense.precision[:99, :99])


def test_matches_curvlinops_kfac():
    """Same G (x) A as curvlinops' KFACLinearOperator (type-2 = exact GGN factors, expand,
    bias inside the factor), when it is importable. Its dependency backpack wants
    torchvision, which does not import beside torch 2.13.0's CPU build, so install it
    without dependencies: ``pip install --no-deps curvlinops-for-pytorch==3.0.1 einops
    einconv linear_operator jaxtyping wadler_lindig``. CI installs it so (``.ci/run``),
    and there (``CI`` set) the test fails rather than skips without it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if os.environ.get("CI"):
            import curvlinops
        else:
            curvlinops = pytest.importorskip("curvlinops")
    model = conv_net()
    x, y = conv_data(n=6)
    params = list(model.parameters())
    data = [(x[:3], y[:3]), (x[3:], y[3:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        operator = curvlinops.KFACLinearOperator(
            model,
            nn.CrossEntropyLoss(reduction="sum"),
            params,
            data,
            fisher_type="type-2",
            separate_weight_and_bias=False,
            check_deterministic=False,
        )
        reference = operator @ torch.eye(sum(p.numel() for p in params))
    la = Laplace(
        model, num_data=6, likelihood="classification", structure="kron", prior_precision=1e-3
    ).fit(data)
    ours = la.precision.dense() - 1e-3 * torch.eye(reference.shape[0])
    assert float(reference.abs().max()) > 1e-2
    assert_close(ours, reference, rtol=1e-9)


def test_other_parameters_get_the_diagonal():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))
    x, y = class_data()
    kwargs = {"num_data": 10, "likelihood": "classification", "prior_precision": 0.2}
    kron = Laplace(model, structure="kron", **kwargs).fit(loader(x, y))
    diag = Laplace(model, structure="diag", **kwargs).fit(loader(x, y))
    assert set(kron.precision.diagonal) == {"1.weight", "1.bias"}
    assert [(b.weight, b.bias) for b in kron.precision.blocks] == [
        ("0.weight", "0.bias"),
        ("3.weight", "3.bias"),
    ]
    for name in ("1.weight", "1.bias"):
        assert_close(kron.precision.diagonal[name], diag.precision[name])


def test_a_subset_without_linear_or_conv_layers_is_all_diagonal():
    """Only LayerNorm weights treated: no Kronecker block, the diagonal of "diag" (this
    raised "`inputs` argument to `grad()` cannot be empty" before)."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))
    x, y = class_data()
    kwargs = {
        "num_data": 10,
        "likelihood": "classification",
        "prior_precision": 0.2,
        "subset": ["1.weight", "1.bias"],
    }
    kron = Laplace(model, structure="kron", **kwargs).fit(loader(x, y))
    diag = Laplace(model, structure="diag", **kwargs).fit(loader(x, y))
    assert kron.precision.blocks == []
    assert set(kron.precision.diagonal) == {"1.weight", "1.bias"}
    for name in ("1.weight", "1.bias"):
        assert_close(kron.precision.diagonal[name], diag.precision[name])


def test_sampling_log_prob_and_penalty_are_those_of_the_dense_precision():
    """Eigendecomposition trick: draws have covariance T Lambda^{-1} exactly (S^T Lambda S =
    I/T from P independent draws), and log_prob/penalty/covariance equal the dense forms."""
    model = mlp()
    x, y = class_data()
    la = Laplace(
        model, num_data=30, likelihood="classification", structure="kron", temperature=0.6
    ).fit(loader(x, y))
    precision = la.precision.dense()
    size = precision.shape[0]
    names = la.treated.names
    mean = torch.cat([la.mean[n].reshape(-1) for n in names])
    draws = la.sample(size, generator=torch.Generator().manual_seed(8))
    delta = torch.cat([draws[n].reshape(size, -1) for n in names], 1) - mean
    noise = torch.randn(size, size, generator=torch.Generator().manual_seed(8))
    root = torch.linalg.solve(noise, delta).T  # delta = noise @ root^T
    assert_close(root.T @ precision @ root, 0.6 * torch.eye(size), rtol=1e-8)
    reference = torch.distributions.MultivariateNormal(mean, precision_matrix=precision / 0.6)
    assert_close(la.log_prob(draws), reference.log_prob(mean + delta), rtol=1e-9)
    expected = 0.5 * torch.einsum("sp,pq,sq->s", delta, precision, delta)
    assert_close(la.penalty(draws), expected)
    variances = torch.cat([la.covariance[n].reshape(-1) for n in names])
    assert_close(variances, 0.6 * torch.diagonal(torch.linalg.inv(precision)), rtol=1e-9)
    # differentiable in the module's parameters: gradient -Lambda delta / T
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(draws[name][0])
    grads = torch.autograd.grad(la.log_prob(model), list(model.parameters()))
    flat_grad = torch.cat([g.reshape(-1) for g in grads])
    assert_close(flat_grad, -(precision @ delta[0]) / 0.6, rtol=1e-9)


def test_temperature_scales_draws_and_predictives_run():
    model = mlp()
    x, y = class_data()
    kwargs = {"num_data": 30, "likelihood": "classification", "structure": "kron"}
    cold = Laplace(model, **kwargs).fit(loader(x, y))
    hot = Laplace(model, temperature=2.0, **kwargs).fit(loader(x, y))
    a = cold.sample(4, generator=torch.Generator().manual_seed(1))
    b = hot.sample(4, generator=torch.Generator().manual_seed(1))
    for name in a:
        assert_close(b[name] - cold.mean[name], math.sqrt(2.0) * (a[name] - cold.mean[name]))
    gen = lambda: torch.Generator().manual_seed(2)  # noqa: E731
    mc = cold.predict(x[:5], num_samples=6, linear=False, generator=gen())
    assert_close(mc, call_stacked(model, cold.sample(6, generator=gen()), x[:5]))
    linear = cold.predict(x[:5], num_samples=6, linear=True, generator=gen())
    assert linear.shape == (6, 5, 3)
    probs = predictive.classification(linear).probs
    assert_close(probs.sum(-1), torch.ones(5))
    zero = Laplace(model, temperature=0.0, **kwargs).fit(loader(x, y))
    draws = zero.sample(2)
    assert all(torch.equal(draws[n][1], zero.mean[n]) for n in draws)


def test_kron_last_layer():
    model = mlp()
    x, y = class_data()
    kwargs = {"num_data": 30, "likelihood": "classification"}
    last = Laplace(model, structure="kron", subset="last_layer", **kwargs).fit(loader(x, y))
    full = Laplace(model, structure="kron", **kwargs).fit(loader(x, y))
    assert last.treated.names == ("2.weight", "2.bias")
    assert_close(last.precision.dense(), block(full.precision, ("2.weight", "2.bias")))


def test_layer_called_twice_is_refused():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, x):
            return self.layer(torch.tanh(self.layer(x)))

    torch.manual_seed(0)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    la = Laplace(Twice(), num_data=4, likelihood="classification", structure="kron")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid model for structure='kron': layer 'layer' (Linear) ran 2 time(s) in one "
            "forward (expected exactly once"
        ),
    ):
        la.fit(loader(x, y))


def test_sequence_inputs_use_kfac_expand():
    """A Linear on (batch, T, in) treats the T positions as examples (expand)."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Flatten(), nn.Linear(8, 2))
    gen = torch.Generator().manual_seed(10)
    x, y = torch.randn(6, 2, 3, generator=gen), torch.randint(0, 2, (6,), generator=gen)
    la = Laplace(model, num_data=6, likelihood="classification", structure="kron").fit(loader(x, y))
    like = make_likelihood("classification", None)
    # brute force on the flattened view: per example, positions summed in G, averaged in A
    g_total, a_total = 0.0, 0.0
    for i in range(6):
        seen = {}
        handle = model[0].register_forward_hook(
            lambda m, a, o, seen=seen: seen.update(a=a[0].detach(), z=o)
        )
        f = model(x[i : i + 1]).reshape(-1)
        handle.remove()
        jac = torch.stack(
            [torch.autograd.grad(f[o], seen["z"], retain_graph=True)[0][0] for o in range(2)]
        )  # (O, T, out)
        hess = output_hessian(like, "ggn", f, y[i])
        for t in range(2):
            g_total = g_total + jac[:, t].T @ hess @ jac[:, t]
        rows = torch.cat([seen["a"][0], torch.ones(2, 1)], 1)
        a_total = a_total + rows.T @ rows
    expected = torch.eye(16) + torch.kron(g_total, a_total / 12)
    got = to_vec_w_tilde(block(la.precision, ("0.weight", "0.bias")), 4, 3, True)
    assert_close(got, expected)
