"""IVON: its posterior on a conjugate model, agreement with ivon-opt 0.1.3, resume, refusals.

The statistical test (``test_conjugate_linear_regression``) and the side-by-side with the
reference (``test_matches_ivon_opt``) are the two claims of issue 25; the rest is the
contract every optimizer of the package keeps (``docs/design.md``).
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import socket

import distributed_workers
import pytest
import torch
from torch import nn

from samplers_as_optim import IVON, call_stacked, name_parameters, predictive

F64 = torch.float64


# ---------------------------------------------------------------------------- helpers
def regression_data(n: int = 40, dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor]:
    """Correlated standardised inputs (mean of x_j^2 = 1) and a noisy linear response."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n, 3, generator=g, dtype=F64)
    corr = torch.tensor([[1.0, 0.8, 0.0], [0.8, 1.0, 0.5], [0.0, 0.5, 1.0]], dtype=F64)
    x = z @ torch.linalg.cholesky(corr).T
    x = x / x.square().mean(0).sqrt()
    y = x @ torch.tensor([1.0, -0.5, 0.25], dtype=F64) + torch.randn(n, generator=g, dtype=F64)
    return x.to(dtype), y.to(dtype)


def mlp(dtype: torch.dtype = F64, seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).to(dtype)


def mlp_data(dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(32, 4, generator=g).to(dtype), torch.randn(32, generator=g).to(dtype)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).squeeze(-1) - y).square().mean()


def unchanged(params, before) -> bool:
    """Whether every tensor of ``params`` equals its copy in ``before``, bit for bit."""
    return all(torch.equal(p, b) for p, b in zip(list(params), before, strict=True))


def train(opt: IVON, model: nn.Module, x, y, steps: int, draws: int = 1) -> list[torch.Tensor]:
    """``steps`` IVON steps of ``draws`` training draws each; the flat mean after each."""
    trace = []
    for _ in range(steps):
        for _ in range(draws):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                mse(model, x, y).backward()
        opt.step()
        trace.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return trace


# ---------------------------------------------------------------------------- the posterior
@pytest.fixture
def one_thread():
    """One torch thread (a tiny model's ops only pay for more), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_conjugate_linear_regression(temperature, one_thread):
    """Mean -> posterior mean, variances -> T / diag(Λ), mean-field VI's optimum.

    Model: y = x·w + noise, noise N(0, 1) known, prior N(0, 1) (weight_decay = 1 / N),
    so the posterior precision is Λ = XᵀX + I and its mean Λ⁻¹Xᵀy. With ess = N the
    loss is the mean NLL ½ mean (y - x·w)², whose Hessian is A = XᵀX / N, and IVON's
    fixed point is m = Λ⁻¹Xᵀy, N (h + δ) = diag(Λ) (module docstring), variances
    T / diag(Λ), well below the marginal variances T diag(Λ⁻¹) of this correlated design.

    Monte Carlo error. R = 100 independent replicates of the problem are the R output
    rows of one ``nn.Linear(3, R)``: the loss sums their mean losses, so each row's
    gradient is its own problem's, and IVON, being mean-field, moves each row on its
    own noise. After a burn-in of 4000 steps (h starts at 0.3 against ~1; the error
    decays as β₂^t, 0.998^4000 < 4e-4) each replicate's mean and variance are averaged
    over K = 2000 steps; those R time averages are independent, so their mean has the
    standard error s / √R (s their spread). The checks allow 5 standard errors (a
    two-sided 6e-7 tail for the t distribution with 99 degrees of freedom, about) plus,
    for the variance, the bias of the h recursion: at stationarity
    E[h] - E[ĥ] = ½(1-β₂) E[(h-ĥ)²/(h+δ)] ≈ ½(1-β₂) Var(ĥ)/(h+δ), and Jensen's
    E[1/(h+δ)] moves the variance by the same order, so |bias| ≤ (1-β₂) Var(ĥ)/(h+δ)²
    relative, with Var(ĥ_i) = c_i²/σ_i² + 2A_ii² + Σ_{j≠i} A_ij² σ_j²/σ_i² for the
    Price estimator ε_i g_i/σ_i² at the optimum (g = A(m + ε) - b, c = Am - b = -δm).
    The test also requires the standard errors to be small (1% of the variances, 2% of
    the posterior standard deviations), so that it can fail.
    """
    x, y = regression_data()
    n, d, replicates = x.shape[0], x.shape[1], 100
    delta = 1.0 / n
    precision = x.T @ x + torch.eye(d, dtype=F64)
    post_mean = torch.linalg.solve(precision, x.T @ y)
    mf_var = temperature / precision.diagonal()
    marginal_var = temperature * torch.linalg.inv(precision).diagonal()

    torch.manual_seed(0)
    model = nn.Linear(d, replicates, bias=False).double()
    beta2 = 0.998
    opt = IVON(
        model.named_parameters(),
        lr=0.05,
        ess=n,
        hess_init=0.3,
        beta2=beta2,
        weight_decay=delta,
        temperature=temperature,
        seed=1,
    )
    burn_in, kept = 4000, 2000
    means = torch.zeros(replicates, d, dtype=F64)
    variances = torch.zeros(replicates, d, dtype=F64)
    for step in range(burn_in + kept):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            (0.5 * (model(x) - y[:, None]).square().sum(1).mean()).backward()
        opt.step()
        if step >= burn_in:
            means += opt.mean["weight"] / kept
            variances += opt.std["weight"].square() / kept

    se_mean = means.std(0) / math.sqrt(replicates)
    se_var = variances.std(0) / math.sqrt(replicates)
    assert (se_mean < 0.02 * marginal_var.sqrt()).all(), se_mean
    assert (se_var < 0.01 * mf_var).all(), se_var

    hess = x.T @ x / n
    shifted = hess.diagonal() + delta  # h + δ at the optimum
    sigma2 = temperature / (n * shifted)
    c = -delta * post_mean
    off = hess.square() * sigma2[None, :] / sigma2[:, None]
    var_hat = c.square() / sigma2 + 2 * hess.diagonal().square() + off.sum(1) - off.diagonal()
    bias = (1 - beta2) * var_hat / shifted.square() * mf_var

    assert ((means.mean(0) - post_mean).abs() <= 5 * se_mean).all(), (means.mean(0), post_mean)
    error = (variances.mean(0) - mf_var).abs()
    assert (error <= 5 * se_var + bias).all(), (variances.mean(0), mf_var, se_var, bias)
    # the test tells the mean-field optimum from the marginal variances Σ_ii: they are
    # further apart than ten times its tolerance
    assert (marginal_var - mf_var > 10 * (5 * se_var + bias)).all()


def test_temperature_multiplies_the_variances():
    """σ² = T / (ess (h + δ)): at a given state, T = 2 doubles every variance."""
    x, y = mlp_data()
    model = mlp()
    opt = IVON(model.named_parameters(), lr=0.1, ess=32, beta2=0.9, seed=0)
    train(opt, model, x, y, steps=5)
    before = opt.std
    opt.param_groups[0]["temperature"] = 2.0
    after = opt.std
    for name in before:
        torch.testing.assert_close(after[name].square(), 2 * before[name].square())


# ---------------------------------------------------------------------------- ivon-opt
def _run_side_by_side(
    monkeypatch, kwargs, *, groups: bool, steps: int = 6, ours_extra=None, ref_extra=None
):
    """Ours and ivon-opt on copies of one model, ivon-opt given our perturbations.

    ``ours_extra`` and ``ref_extra`` add arguments to one side. Our draw's perturbation ε
    is read back inside ``sampled_params`` (the parameters minus the saved mean);
    ivon-opt draws ``noise = randn / sqrt(ess (h + δ))`` per group, so its ``torch.randn``
    is replaced by ε sqrt(ess (h + δ)) with its own h. Returns the two models and
    optimizers after ``steps`` steps of ``mc_samples`` draws.
    """
    ivon = pytest.importorskip("ivon", reason="the reference ivon-opt 0.1.3 is not installed")
    x, y = mlp_data()
    ours_model, ref_model = mlp(), mlp()

    def param_groups(model, named):
        layers = [model[0], model[2]]
        if not groups:
            return model.named_parameters() if named else model.parameters()
        # (named apart, as the model names them: one name twice would share its noise)
        return [
            {"params": list(layers[0].named_parameters("0") if named else layers[0].parameters())},
            {
                "params": list(
                    layers[1].named_parameters("2") if named else layers[1].parameters()
                ),
                "lr": kwargs["lr"] / 2,
                "weight_decay": 0.05,
            },
        ]

    ours = IVON(param_groups(ours_model, True), **{**kwargs, **(ours_extra or {})}, seed=7)
    ref = ivon.IVON(param_groups(ref_model, False), **{**kwargs, **(ref_extra or {})})
    draws = kwargs.get("mc_samples", 1)
    for _ in range(steps):
        for _ in range(draws):
            means = [p.detach().clone() for p in ours_model.parameters()]
            with ours.sampled_params(train=True):
                params = list(ours_model.parameters())
                eps = [p.detach() - m for p, m in zip(params, means, strict=True)]
                ours.zero_grad()
                mse(ours_model, x, y).backward()
            chunks, start = [], 0
            for group in ref.param_groups:
                count = len(group["params"])
                flat = torch.cat([e.flatten() for e in eps[start : start + count]])
                start += count
                scale = (group["ess"] * (group["hess"] + group["weight_decay"])).sqrt()
                chunks.append(flat * scale)
            with monkeypatch.context() as patch:
                patch.setattr(torch, "randn", lambda *_, chunks=chunks, **__: chunks.pop(0))
                with ref.sampled_params(train=True):
                    ref.zero_grad()
                    mse(ref_model, x, y).backward()
            assert not chunks
        ours.step()
        ref.step()
    return ours_model, ours, ref_model, ref


def _flat_state(opt: IVON, key: str, group: dict) -> torch.Tensor:
    return torch.cat([opt.state[p][key].flatten() for p in group["params"]])


# float64 rounding is 1.1e-16 per operation; the Price estimate ε g / σ² divides a
# product of rounded numbers by σ², which leaves the relative error of an operation or
# two, and six steps compound a few of them: the two runs agree to 1e-12 relative
# (observed: 1e-16 absolute on values of order 1).
TOLERANCE = {"rtol": 1e-12, "atol": 1e-14}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.05, "ess": 32, "hess_init": 0.5, "beta1": 0.8, "beta2": 0.95,
         "weight_decay": 1e-2, "mc_samples": 2, "clip_radius": 0.5},
        {"lr": 0.1, "ess": 100, "hess_approx": "gradsq", "beta2": 0.9, "debias": False},
        {"lr": 0.02, "ess": 10, "rescale_lr": False, "weight_decay": 0.0, "beta2": 0.99},
    ],
)  # fmt: skip
@pytest.mark.parametrize("groups", [False, True])
def test_matches_ivon_opt(monkeypatch, kwargs, groups):
    """The same arguments and the same perturbations give ivon-opt's steps to rounding."""
    ours_model, ours, ref_model, ref = _run_side_by_side(monkeypatch, kwargs, groups=groups)
    for p, q in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOLERANCE)
    for mine, theirs in zip(ours.param_groups, ref.param_groups, strict=True):
        torch.testing.assert_close(_flat_state(ours, "hess", mine), theirs["hess"], **TOLERANCE)
        torch.testing.assert_close(
            _flat_state(ours, "momentum", mine), theirs["momentum"], **TOLERANCE
        )


def test_temperature_is_ivon_opts_ess_over_t(monkeypatch):
    """With "price", IVON(ess=N, temperature=T) takes ivon-opt's IVON(ess=N / T) steps."""
    kwargs = {"lr": 0.05, "ess": 16, "beta2": 0.9, "weight_decay": 1e-2}
    ours_model, _, ref_model, _ = _run_side_by_side(
        monkeypatch, kwargs, groups=False, ours_extra={"temperature": 2.0}, ref_extra={"ess": 8}
    )
    for p, q in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOLERANCE)


# ---------------------------------------------------------------------------- resume
def _opt(model: nn.Module, **kwargs) -> IVON:
    settings = {"lr": 0.05, "ess": 32, "beta2": 0.9, "mc_samples": 2, "seed": 3, **kwargs}
    return IVON(model.named_parameters(), **settings)


def test_state_dict_resumes_bit_for_bit():
    x, y = mlp_data()
    model = mlp()
    opt = _opt(model)
    train(opt, model, x, y, steps=3, draws=2)
    with opt.sampled_params(train=True):  # a checkpoint between two draws of a step
        opt.zero_grad()
        mse(model, x, y).backward()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    with opt.sampled_params(train=True):
        opt.zero_grad()
        mse(model, x, y).backward()
    opt.step()
    expected = train(opt, model, x, y, steps=3, draws=2)

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed_model = mlp(seed=5)
    resumed_model.load_state_dict(saved["model"])
    resumed = _opt(resumed_model, seed=99)  # the seed comes from the checkpoint
    resumed.load_state_dict(saved["opt"])
    with resumed.sampled_params(train=True):
        resumed.zero_grad()
        mse(resumed_model, x, y).backward()
    resumed.step()
    got = train(resumed, resumed_model, x, y, steps=3, draws=2)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_and_pickle_continue_bit_for_bit(how):
    x, y = mlp_data()
    model = mlp()
    opt = _opt(model)
    train(opt, model, x, y, steps=2, draws=2)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    expected = train(opt, model, x, y, steps=3, draws=2)
    got = train(opt2, model2, x, y, steps=3, draws=2)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_no_global_rng_after_construction_and_seed_none_uses_it():
    x, y = mlp_data()
    model = mlp()
    torch.manual_seed(11)
    first = IVON(model.parameters(), lr=0.1, ess=32).seed
    torch.manual_seed(11)
    opt = IVON(model.parameters(), lr=0.1, ess=32)
    assert opt.seed == first
    state = torch.get_rng_state()
    train(opt, model, x, y, steps=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_evaluation_draws_do_not_change_training():
    x, y = mlp_data()
    runs = []
    for evaluate in (False, True):
        model = mlp()
        opt = _opt(model, mc_samples=1)
        for _ in range(4):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                mse(model, x, y).backward()
            if evaluate:
                with opt.sampled_params(), torch.no_grad():
                    model(x)
            opt.step()
            if evaluate:
                with opt.sampled_params(), torch.no_grad():
                    model(x)
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])


def _recording(take, taken: list):
    def recorded(*args):
        taken.append(take(*args))
        return taken[-1]

    return recorded


def test_overlapped_noise_is_the_same_noise():
    """Drawn ahead on the worker thread (a large parameter) or on the spot: one run."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 300, dtype=F64), torch.randn(16, 300, dtype=F64)
    runs = []
    for overlap in (True, False):
        model = nn.Linear(300, 300).double()  # 90 000 weights: drawn ahead
        model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
        opt = IVON(
            model.named_parameters(), lr=0.05, ess=16, mc_samples=2, seed=2, overlap_noise=overlap
        )
        taken: list = []
        if overlap:  # (the prefetcher's buffers are used, not drawn again)
            opt._prefetcher.take = _recording(opt._prefetcher.take, taken)
        for _ in range(3):
            for _ in range(2):
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    (model(x) - y).square().mean().backward()
                with opt.sampled_params():  # an evaluation draw between: not prefetched
                    pass
            opt.step()
        runs.append(model.weight.detach().clone())
        if overlap:  # each training draw but the first was drawn ahead, for the weight
            assert sum(t is not None for t in taken) == 5
    assert torch.equal(runs[0], runs[1])


# ---------------------------------------------------------------------------- the API
def test_sample_layout_and_predictive():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, labels = torch.randn(20, 4), torch.randint(0, 3, (20,))
    opt = IVON(model.named_parameters(), lr=0.1, ess=20, seed=0)
    for _ in range(3):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), labels).backward()
        opt.step()
    samples = opt.sample(6, generator=torch.Generator().manual_seed(0))
    assert set(samples) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        assert samples[name].shape == (6, *param.shape)
    logits = call_stacked(model, samples, x)
    assert logits.shape == (6, 20, 3)
    prediction = predictive.classification(opt.predict(model, x, 5))
    assert prediction.probs.shape == (20, 3)
    assert torch.allclose(prediction.probs.sum(-1), torch.ones(20))


def test_samples_have_the_posterior_moments():
    """n = 20000 draws: mean and variance within 5 standard errors of m and σ².

    The sample mean's standard error is σ/√n, the sample variance's √(2/(n-1)) σ².
    """
    model = mlp()
    x, y = mlp_data()
    opt = _opt(model, mc_samples=1)
    train(opt, model, x, y, steps=3)
    n = 20000
    samples = opt.sample(n, generator=torch.Generator().manual_seed(1))
    for name, mean in opt.mean.items():
        std = opt.std[name]
        assert ((samples[name].mean(0) - mean).abs() <= 5 * std / math.sqrt(n)).all()
        var = samples[name].var(0)
        assert ((var - std.square()).abs() <= 5 * math.sqrt(2 / (n - 1)) * std.square()).all()


def test_sampled_params_perturbs_and_restores_exactly():
    model = mlp()
    x, y = mlp_data()
    opt = _opt(model, mc_samples=1)
    before = [p.detach().clone() for p in model.parameters()]
    with opt.sampled_params(train=True):
        params = list(model.parameters())
        assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        opt.zero_grad()
        mse(model, x, y).backward()
        assert torch.equal(opt.mean["0.weight"], before[0])
    assert unchanged(model.parameters(), before)
    with pytest.raises(KeyError), opt.sampled_params(train=True):
        raise KeyError("boom")
    assert unchanged(model.parameters(), before)
    assert opt.param_groups[0]["train_draws"] == 1  # the failed draw is not counted


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_dtypes(dtype):
    model = mlp(dtype)
    x, y = mlp_data(dtype)
    opt = _opt(model, mc_samples=1)
    trace = train(opt, model, x, y, steps=4)
    assert trace[-1].dtype == dtype and torch.isfinite(trace[-1]).all()
    assert all(opt.state[p]["hess"].dtype == dtype for p in model.parameters())
    assert all(s.dtype == dtype for s in opt.sample(2).values())


def test_param_groups_and_frozen_parameters():
    model = mlp()
    x, y = mlp_data()
    model[2].bias.requires_grad_(False)
    frozen = model[2].bias.detach().clone()
    opt = IVON(
        [
            {"params": list(model[0].named_parameters("0")), "lr": 0.0},
            {"params": list(model[2].named_parameters("2")), "temperature": 2.0},
        ],
        lr=0.1,
        ess=32,
        seed=0,
    )
    first = model[0].weight.detach().clone()
    with opt.sampled_params(train=True):
        assert torch.equal(model[2].bias, frozen)
        opt.zero_grad()
        mse(model, x, y).backward()
    opt.step()
    assert torch.equal(model[0].weight, first)  # lr = 0 in group 0
    assert torch.equal(model[2].bias, frozen)  # frozen: neither perturbed nor updated
    assert "2.bias" not in opt.sample(1)
    assert not torch.equal(model[2].weight, mlp()[2].weight)


def test_step_lr_scheduler():
    """StepLR(gamma=0) sets lr to 0 after two steps: the mean then stops, h goes on."""
    model = mlp()
    x, y = mlp_data()
    opt = _opt(model, mc_samples=1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.0)
    trace = []
    for _ in range(4):
        trace += train(opt, model, x, y, steps=1)
        scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.0
    assert not torch.equal(trace[0], trace[1])
    assert torch.equal(trace[1], trace[2]) and torch.equal(trace[2], trace[3])


def test_closure_forms_agree():
    """step(closure) draws around each call; a closure that opens its own draw works too."""
    x, y = mlp_data()
    results = []
    for style in ("plain", "ivon", "manual"):
        model = mlp()
        opt = _opt(model)

        def plain(model=model, opt=opt):
            opt.zero_grad()
            loss = mse(model, x, y)
            loss.backward()
            return loss

        def ivon_style(model=model, opt=opt):
            with opt.sampled_params(train=True):
                return plain(model, opt)

        for _ in range(3):
            if style == "manual":
                losses = []
                for _ in range(2):
                    with opt.sampled_params(train=True):
                        losses.append(plain(model, opt))
                opt.step()
                loss = sum(losses) / 2
            else:
                loss = opt.step(plain if style == "plain" else ivon_style)
        results.append(
            (loss.detach(), torch.cat([p.detach().flatten() for p in model.parameters()]))
        )
    for loss, params in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(params, results[0][1])


def test_zero_temperature_with_squared_gradients():
    """T = 0 ("gradsq"): no perturbation; the run is deterministic whatever the seed."""
    x, y = mlp_data()
    runs = []
    for seed in (0, 1):
        model = mlp()
        opt = IVON(
            model.named_parameters(), lr=0.1, ess=32, hess_approx="gradsq", temperature=0.0,
            seed=seed,
        )  # fmt: skip
        before = [p.detach().clone() for p in model.parameters()]
        with opt.sampled_params():
            assert unchanged(model.parameters(), before)
        runs.append(train(opt, model, x, y, steps=3)[-1])
        samples = opt.sample(3)
        assert torch.equal(samples["0.weight"], model[0].weight.detach().expand(3, -1, -1))
    assert torch.equal(runs[0], runs[1])


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": -1.0}, ValueError, r"Invalid lr: -1\.0 \(expected a finite number >= 0"),
        ({"lr": math.nan}, ValueError, r"Invalid lr: nan"),
        ({"ess": 0}, ValueError, r"Invalid ess: 0 \(expected a finite number > 0"),
        ({"ess": "N"}, TypeError, r"Invalid ess: 'N'"),
        ({"hess_init": 0.0}, ValueError, r"Invalid hess_init: 0\.0 \(expected a finite number > 0"),
        ({"beta1": 1.0}, ValueError, r"Invalid beta1: 1\.0 \(expected a number in \[0, 1\): the bias"),
        ({"beta2": 1.5}, ValueError, r"Invalid beta2: 1\.5 \(expected a number in \[0, 1\]"),
        ({"weight_decay": -0.1}, ValueError, r"Invalid weight_decay: -0\.1 \(expected a finite"),
        ({"mc_samples": 0}, ValueError, r"Invalid mc_samples: 0 \(expected an integer >= 1"),
        ({"mc_samples": 1.5}, TypeError, r"Invalid mc_samples: 1\.5"),
        ({"hess_approx": "fisher"}, ValueError, r"Invalid hess_approx: 'fisher' \(expected one of 'price', 'gradsq'"),
        ({"clip_radius": 0.0}, ValueError, r"Invalid clip_radius: 0\.0 \(expected a number > 0, or inf"),
        ({"sync": 1}, TypeError, r"Invalid sync: 1 \(expected True or False"),
        ({"debias": None}, TypeError, r"Invalid debias: None"),
        ({"rescale_lr": "yes"}, TypeError, r"Invalid rescale_lr: 'yes'"),
        ({"temperature": -1.0}, ValueError, r"Invalid temperature: -1\.0 \(expected a finite number > 0"),
        ({"temperature": 0.0}, ValueError, r"Invalid temperature: 0\.0 .*variance T / \(ess \(h \+ weight_decay\)\), which is 0 at T = 0; use hess_approx='gradsq'"),
        ({"temperature": -1.0, "hess_approx": "gradsq"}, ValueError, r"Invalid temperature: -1\.0 \(expected a finite number >= 0"),
        ({"seed": -1}, ValueError, r"Invalid seed: -1 \(expected None or an integer in \[0, 2\*\*64\)"),
        ({"overlap_noise": None}, TypeError, r"Invalid overlap_noise: None"),
    ],
)  # fmt: skip
def test_refuses_bad_arguments(kwargs, error, match):
    settings = {"lr": 0.1, "ess": 10, **kwargs}
    with pytest.raises(error, match=match):
        IVON(mlp().parameters(), **settings)


def test_refuses_misuse():
    model = mlp()
    opt = IVON(model.parameters(), lr=0.1, ess=32, seed=0)
    with pytest.raises(RuntimeError, match=r"at least one sampled_params\(train=True\)"):
        opt.step()
    nested = pytest.raises(RuntimeError, match=r"sampled_params\(\) inside")
    with opt.sampled_params(), nested, opt.sampled_params():
        pass
    with opt.sampled_params(train=True), pytest.raises(RuntimeError, match=r"step\(\) inside"):
        opt.step()
    with pytest.raises(ValueError, match=r"has no name.*named_parameters\(\)"):
        opt.sample(2)
    name_parameters(model)
    assert set(opt.sample(2)) == {name for name, _ in model.named_parameters()}
    with pytest.raises(ValueError, match=r"Invalid n: 0"):
        opt.sample(0)
    with pytest.raises(TypeError, match=r"Invalid params: a torch.int64 tensor"):
        IVON([torch.zeros(3, dtype=torch.int64)], lr=0.1, ess=1)
    with pytest.raises(ValueError, match=r"expected the state_dict\(\) of an IVON"):
        opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())


def test_refuses_a_bad_group_and_a_schedule_that_moves_out_of_range():
    model = mlp()
    opt = IVON(model[0].parameters(), lr=0.1, ess=32, seed=0)
    with pytest.raises(ValueError, match=r"Invalid beta2 in param group 1: 2\.0"):
        opt.add_param_group({"params": model[2].parameters(), "beta2": 2.0})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": model[2].parameters()})
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[1]["temperature"] = 0.0  # a schedule cooled it to 0 with "price"
    refused = pytest.raises(ValueError, match=r"Invalid temperature in param group 1: 0\.0")
    with refused, opt.sampled_params():
        pass
    assert unchanged(model.parameters(), before)  # group 0 was not drawn either


def test_state_dict_holds_the_averages_only_within_a_step():
    model = mlp()
    x, y = mlp_data()
    opt = _opt(model)
    train(opt, model, x, y, steps=1, draws=2)
    assert all(
        set(s) == {"momentum", "hess", "noise_key"} for s in opt.state_dict()["state"].values()
    )
    with opt.sampled_params(train=True):
        opt.zero_grad()
        mse(model, x, y).backward()
    saved = opt.state_dict()
    assert all({"avg_grad", "avg_nxg"} <= set(s) for s in saved["state"].values())
    assert saved["param_groups"][0]["train_draws"] == 1


def test_refuses_a_non_finite_gradient_and_changes_nothing():
    model = mlp()
    x, y = mlp_data()
    opt = _opt(model, mc_samples=1)
    train(opt, model, x, y, steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    hess = [opt.state[p]["hess"].clone() for p in model.parameters()]
    with opt.sampled_params(train=True):
        opt.zero_grad()
        (mse(model, x, y) * math.inf).backward()
    with pytest.raises(
        FloatingPointError, match=r"refused step 3: non-finite gradient in param group 0"
    ):
        opt.step()
    assert unchanged(model.parameters(), before)
    assert unchanged([opt.state[p]["hess"] for p in model.parameters()], hess)
    train(opt, model, x, y, steps=1)  # the refused draws were discarded: training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------------------- sync
def _sync_rank(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks: half the data each, no DDP, ``sync=True``, ``seed=None``."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        x, y = mlp_data()
        model = mlp()
        torch.manual_seed(100 + rank)  # each rank's global RNG gives it another seed
        opt = IVON(model.named_parameters(), lr=0.05, ess=32, beta2=0.9, sync=True)
        half = slice(16 * rank, 16 * rank + 16)
        trace = train(opt, model, x[half], y[half], steps=4)
        torch.save({"seed": opt.seed, "params": trace[-1]}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_sync_over_two_ranks_is_the_one_process_run(tmp_path):
    """Each rank averages the other's statistics: the full-batch run, to rounding.

    The ranks agree on rank 0's seed (they drew different ones), so they draw one
    perturbation, and the average of their half-batch mean gradients is the full batch's.
    """
    mp = pytest.importorskip("torch.multiprocessing")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.spawn(_sync_rank, args=(port, str(tmp_path)), nprocs=2, join=False)
    paths = [tmp_path / f"rank{rank}.pt" for rank in (0, 1)]
    distributed_workers.join_ranks(context, paths, "IVON's sync over 2 ranks")
    ranks = [torch.load(path) for path in paths]
    assert ranks[0]["seed"] == ranks[1]["seed"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    x, y = mlp_data()
    model = mlp()
    opt = IVON(model.named_parameters(), lr=0.05, ess=32, beta2=0.9, seed=ranks[0]["seed"])
    expected = train(opt, model, x, y, steps=4)[-1]
    torch.testing.assert_close(ranks[0]["params"], expected, **TOLERANCE)


def test_a_weight_decay_that_leaves_a_negative_precision_is_refused():
    """h may go below 0 down to -weight_decay (only h + δ is kept positive); a smaller δ
    set later is refused before anything changes, naming the cause (it made NaN draws)."""
    import re as _re

    import torch as _torch

    from samplers_as_optim import IVON as _IVON

    param = _torch.nn.Parameter(_torch.zeros(1000))
    opt = _IVON([("w", param)], lr=0.1, ess=100, hess_init=0.1, beta2=0.9, weight_decay=0.1,
                seed=0)  # fmt: skip
    for _ in range(50):
        with opt.sampled_params(train=True):
            param.grad = None
            (0.01 * param).sum().backward()
        opt.step()
    assert float(opt.state[param]["hess"].min()) < 0
    kept = param.detach().clone()
    opt.param_groups[0]["weight_decay"] = 0.0
    message = "Invalid weight_decay in param group 0: 0.0"
    with pytest.raises(ValueError, match=_re.escape(message)), opt.sampled_params(train=True):
        pass
    assert _torch.equal(param.detach(), kept)
