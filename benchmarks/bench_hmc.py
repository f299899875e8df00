"""HMC's effective samples per second against Pyro's HMC and BlackJAX's HMC; K chains at once.

Same target, same start, same leapfrog step and number of steps, identity mass, no
adaptation, one thread each (``torch.set_num_threads(1)``; XLA's CPU client with one
intra-op thread), float32:

* ``logreg``: Bayesian logistic regression on scikit-learn's breast cancer (569 x 30,
  standardised, intercept; prior N(0, 1)), 10 leapfrog steps;
* ``mlp``: a 64-16-10 tanh MLP on digits (1257 images, full batch; prior N(0, 1)),
  10 leapfrog steps.

Contenders: ``samplers_as_optim.HMC`` (``lr = N eps^2``, so its leapfrog step is eps)
driven by a closure (``ours``, eager: one Python round trip per leapfrog step), by a
loss function with ``compile=True`` (``ours_compiled``: each transition one
``torch.compile`` graph, still one ``step`` call per draw), and ``HMC.run`` with
``compile=True`` (``ours_run``: all the draws in one call, up to 64 transitions per
compiled ``while_loop``, the same chain as ``ours_compiled``); ``pyro.infer.HMC`` with a
``potential_fn`` (Pyro's default, no JIT); ``blackjax.hmc`` with its step jitted and the
whole chain run by ``jax.lax.scan`` (``blackjax``: no Python between draws), and the
same jitted step called once per draw from a Python loop (``blackjax_step``, the shape
of a training loop, as ours). Compile times are excluded. ESS is ``diagnostics.ess``
(bulk) of each coordinate; ESS/s is the median over coordinates divided by the wall time
of the draws. The contenders run in
alternating rounds; ratios are medians of per-round ratios.

Ensemble: K = 16 chains of the MLP in one :class:`~samplers_as_optim.ParallelEnsemble`
(one loss per member: one vmapped forward/backward per leapfrog step for all chains)
against a loop over 16 single-chain ``HMC`` optimizers, the same number of transitions;
also for a 30-16-1 MLP on breast cancer (569 rows, one logit), whose forward/backward is
cheaper (the digits MLP's full batch spends most of its time in kernels: ``log_softmax``
over 10 classes, ``tanh``, which stacking does not shorten).

Run: ``python benchmarks/bench_hmc.py`` (``--quick`` for fewer draws; ``--part ess
--problem logreg`` for the logistic regression's comparison alone). Needs the
``bench`` extra (pyro-ppl, jax, blackjax); a contender whose package is missing is
skipped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import numpy as np
import torch
import torch.nn.functional as F

from samplers_as_optim import HMC, ParallelEnsemble, diagnostics


# ---------------------------------------------------------------- problems
def logreg_data() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    x = np.concatenate([x, np.ones((len(x), 1))], 1)
    return x.astype(np.float32), y.astype(np.float32)


def mlp_data() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x[:1257] / 16.0).astype(np.float32), y[:1257].astype(np.int64)


HIDDEN = 16


class Problem:
    """A potential U(theta) = N mean loss + |theta|^2 / 2 over a flat parameter vector."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "logreg":
            self.x, self.y = logreg_data()
            self.dim = self.x.shape[1]
            self.eps, self.num_steps = 0.05, 10
        else:
            self.x, self.y = mlp_data()
            self.dim = 64 * HIDDEN + HIDDEN + HIDDEN * 10 + 10
            self.eps, self.num_steps = 0.02, 10
        self.n = len(self.x)
        self.tx = torch.from_numpy(self.x)
        self.ty = torch.from_numpy(self.y)

    # the mean loss of one flat parameter vector (torch)
    def mean_loss(self, theta: torch.Tensor) -> torch.Tensor:
        if self.name == "logreg":
            logits = self.tx @ theta
            return F.binary_cross_entropy_with_logits(logits, self.ty)
        w1, b1, w2, b2 = self.split(theta)
        h = torch.tanh(self.tx @ w1 + b1)
        return F.cross_entropy(h @ w2 + b2, self.ty)

    def split(self, theta: Any) -> tuple[Any, Any, Any, Any]:
        sizes = (64 * HIDDEN, HIDDEN, HIDDEN * 10, 10)
        cuts = np.cumsum(sizes)[:-1]
        if isinstance(theta, torch.Tensor):
            parts = torch.split(theta, sizes)
        else:
            import jax.numpy as jnp

            parts = jnp.split(theta, cuts)
        return (
            parts[0].reshape(64, HIDDEN),
            parts[1],
            parts[2].reshape(HIDDEN, 10),
            parts[3],
        )

    def potential(self, theta: torch.Tensor) -> torch.Tensor:
        return self.n * self.mean_loss(theta) + 0.5 * (theta * theta).sum()

    def jax_logdensity(self) -> Callable[[Any], Any]:
        import jax
        import jax.numpy as jnp

        x, y = jnp.asarray(self.x), jnp.asarray(self.y)
        if self.name == "logreg":

            def logdensity(theta):
                logits = x @ theta
                nll = jnp.sum(jnp.logaddexp(0.0, logits) - y * logits)
                return -nll - 0.5 * jnp.sum(theta**2)

            return logdensity

        def logdensity(theta):
            w1, b1, w2, b2 = self.split(theta)
            logits = jnp.tanh(x @ w1 + b1) @ w2 + b2
            nll = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
            return -nll - 0.5 * jnp.sum(theta**2)

        return logdensity


# ---------------------------------------------------------------- contenders
def make_hmc(
    problem: Problem, start: np.ndarray, seed: int, compile: bool = False
) -> tuple[torch.nn.Parameter, HMC]:
    """A chain at ``start``: leapfrog step eps (``lr = N eps^2``), prior N(0, 1)."""
    theta = torch.nn.Parameter(torch.from_numpy(start.copy()))
    opt = HMC(
        [theta],
        lr=problem.n * problem.eps**2,
        num_steps=problem.num_steps,
        num_data=problem.n,
        weight_decay=1.0 / problem.n,
        seed=seed,
        compile=compile,
    )
    return theta, opt


def ours(problem: Problem, start: np.ndarray, draws: int, seed: int) -> tuple[np.ndarray, float]:
    theta, opt = make_hmc(problem, start, seed)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = problem.mean_loss(theta)
        loss.backward()
        return loss

    out = np.empty((draws, problem.dim), dtype=np.float32)
    started = time.perf_counter()
    for t in range(draws):
        opt.step(closure)
        out[t] = theta.detach().numpy()
    return out, time.perf_counter() - started


def ours_compiled(
    problem: Problem, start: np.ndarray, draws: int, seed: int
) -> tuple[np.ndarray, float]:
    """``HMC(..., compile=True).step(loss_fn=...)``: one compiled graph per transition."""

    def loss_fn(params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return problem.mean_loss(params[0])

    _, warm = make_hmc(problem, start, seed, compile=True)  # compiles (once per process)
    for _ in range(2):
        warm.step(loss_fn=loss_fn)
    theta, opt = make_hmc(problem, start, seed, compile=True)
    out = np.empty((draws, problem.dim), dtype=np.float32)
    started = time.perf_counter()
    for t in range(draws):
        opt.step(loss_fn=loss_fn)
        out[t] = theta.detach().numpy()
    return out, time.perf_counter() - started


def ours_run(
    problem: Problem, start: np.ndarray, draws: int, seed: int
) -> tuple[np.ndarray, float]:
    """``HMC(..., compile=True).run(loss_fn, draws)``: up to 64 transitions per compiled call."""

    def loss_fn(params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return problem.mean_loss(params[0])

    _, warm = make_hmc(problem, start, seed, compile=True)  # compiles (once per process)
    warm.run(loss_fn, 2)
    _, opt = make_hmc(problem, start, seed, compile=True)
    started = time.perf_counter()
    samples = opt.run(loss_fn, draws).samples["0"].numpy()
    return samples, time.perf_counter() - started


def pyro_hmc(
    problem: Problem, start: np.ndarray, draws: int, seed: int
) -> tuple[np.ndarray, float]:
    import pyro
    from pyro.infer import HMC as PyroHMC  # noqa: N811
    from pyro.infer import MCMC

    pyro.set_rng_seed(seed)

    def potential_fn(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return problem.potential(params["theta"])

    kernel = PyroHMC(
        potential_fn=potential_fn,
        step_size=problem.eps,
        num_steps=problem.num_steps,
        adapt_step_size=False,
        adapt_mass_matrix=False,
    )
    mcmc = MCMC(
        kernel,
        num_samples=draws,
        warmup_steps=0,
        disable_progbar=True,
        initial_params={"theta": torch.from_numpy(start.copy())},
    )
    started = time.perf_counter()
    mcmc.run()
    elapsed = time.perf_counter() - started
    return mcmc.get_samples()["theta"].numpy(), elapsed


_BLACKJAX_CACHE: dict[tuple[str, int], Any] = {}


def blackjax_hmc(
    problem: Problem, start: np.ndarray, draws: int, seed: int
) -> tuple[np.ndarray, float]:
    import blackjax
    import jax
    import jax.numpy as jnp

    key = (problem.name, draws)
    if key not in _BLACKJAX_CACHE:
        kernel = blackjax.hmc(
            problem.jax_logdensity(),
            step_size=problem.eps,
            inverse_mass_matrix=jnp.ones(problem.dim),
            num_integration_steps=problem.num_steps,
        )

        @jax.jit
        def run(state, rng):
            def one(state, k):
                state, _ = kernel.step(k, state)
                return state, state.position

            return jax.lax.scan(one, state, jax.random.split(rng, draws))[1]

        _BLACKJAX_CACHE[key] = (kernel, run)
        kernel0, run0 = _BLACKJAX_CACHE[key]
        run0(kernel0.init(jnp.asarray(start)), jax.random.PRNGKey(0)).block_until_ready()
    kernel, run = _BLACKJAX_CACHE[key]
    state = kernel.init(jnp.asarray(start))
    started = time.perf_counter()
    positions = run(state, jax.random.PRNGKey(seed)).block_until_ready()
    return np.asarray(positions), time.perf_counter() - started


_BLACKJAX_STEP_CACHE: dict[str, Any] = {}


def blackjax_step(
    problem: Problem, start: np.ndarray, draws: int, seed: int
) -> tuple[np.ndarray, float]:
    """BlackJAX's jitted step called once per draw from Python (no ``lax.scan``)."""
    import blackjax
    import jax
    import jax.numpy as jnp

    if problem.name not in _BLACKJAX_STEP_CACHE:
        kernel = blackjax.hmc(
            problem.jax_logdensity(),
            step_size=problem.eps,
            inverse_mass_matrix=jnp.ones(problem.dim),
            num_integration_steps=problem.num_steps,
        )
        step = jax.jit(kernel.step)
        state = kernel.init(jnp.asarray(start))
        step(jax.random.PRNGKey(0), state)[0].position.block_until_ready()
        _BLACKJAX_STEP_CACHE[problem.name] = (kernel, step)
    kernel, step = _BLACKJAX_STEP_CACHE[problem.name]
    state = kernel.init(jnp.asarray(start))
    keys = jax.random.split(jax.random.PRNGKey(seed), draws)
    out = np.empty((draws, problem.dim), dtype=np.float32)
    started = time.perf_counter()
    for t in range(draws):
        state, _ = step(keys[t], state)
        out[t] = np.asarray(state.position)
    return out, time.perf_counter() - started


def ess_per_second(draws: np.ndarray, elapsed: float) -> tuple[float, float]:
    ess = diagnostics.ess(torch.from_numpy(draws.astype(np.float64))[None])
    return float(ess.median()), float(ess.median()) / elapsed


def available(contenders: dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    found = {name: contenders[name] for name in ("ours", "ours_compiled", "ours_run")}
    for name, module in (("pyro", "pyro"), ("blackjax", "blackjax"), ("blackjax_step", "blackjax")):
        try:
            __import__(module)
            found[name] = contenders[name]
        except ImportError:
            print(f"{name}: not installed, skipped")
    return found


def compare(problem: Problem, draws: int, rounds: int) -> dict[str, Any]:
    # a common start near the posterior: 200 transitions of ours from zero
    start, _ = ours(problem, np.zeros(problem.dim, np.float32), 200, seed=123)
    start = start[-1]
    contenders = available(
        {
            "ours": ours,
            "ours_compiled": ours_compiled,
            "ours_run": ours_run,
            "pyro": pyro_hmc,
            "blackjax": blackjax_hmc,
            "blackjax_step": blackjax_step,
        }
    )
    per_round: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n in contenders}
    for r in range(rounds):
        for name, fn in contenders.items():
            samples, elapsed = fn(problem, start, draws, seed=r)
            accept = float(np.mean(np.any(np.diff(samples, axis=0) != 0, axis=1)))
            ess, rate = ess_per_second(samples, elapsed)
            per_round[name].append((elapsed, ess, rate, accept))
    summary: dict[str, Any] = {}
    for name, values in per_round.items():
        summary[name] = {
            "seconds": statistics.median(v[0] for v in values),
            "ess": statistics.median(v[1] for v in values),
            "ess_per_s": statistics.median(v[2] for v in values),
            "accept": statistics.median(v[3] for v in values),
        }
    pairs = [
        (mine, other) for mine in ("ours", "ours_compiled", "ours_run") for other in contenders
    ]
    pairs.append(("ours_run", "ours_compiled"))  # what one call for many transitions saves
    for mine, other in pairs:
        if not other.startswith("ours") or (mine, other) == ("ours_run", "ours_compiled"):
            ratios = [a[2] / b[2] for a, b in zip(per_round[mine], per_round[other], strict=True)]
            summary[f"{mine}/{other}"] = statistics.median(ratios)
    return summary


def ensemble_vs_loop(
    draws: int, rounds: int, k: int = 16, data: str = "digits"
) -> dict[str, float]:
    """K MLP chains in one ParallelEnsemble against a loop of K single-chain optimizers.

    ``data="digits"``: the 64-16-10 MLP above (10 classes, 1257 images); ``"cancer"``: a
    30-16-1 MLP on breast cancer (569 rows, one logit), whose forward/backward is cheaper.
    """
    problem = Problem("mlp")
    x, y, n = problem.tx, problem.ty, problem.n
    inputs, outputs = 64, 10
    if data == "cancer":
        xs, ys = logreg_data()
        x, y, n = torch.from_numpy(xs[:, :-1].copy()), torch.from_numpy(ys), len(xs)
        inputs, outputs = 30, 1

    def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean loss: logits [n, outputs] -> [], or per member [K, n, outputs] -> [K]."""
        if logits.dim() == 2:  # one chain
            if outputs == 1:
                return F.binary_cross_entropy_with_logits(logits.squeeze(-1), target)
            return F.cross_entropy(logits, target)
        members = logits.shape[0]
        if outputs == 1:
            losses = F.binary_cross_entropy_with_logits(
                logits.squeeze(-1), target.expand(members, -1), reduction="none"
            )
        else:
            losses = F.cross_entropy(
                logits.reshape(-1, outputs), target.repeat(members), reduction="none"
            )
        return losses.view(members, n).mean(1)

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(inputs, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, outputs)
        )

    torch.manual_seed(0)
    models = [net() for _ in range(k)]
    options = {
        "lr": n * problem.eps**2,
        "num_steps": problem.num_steps,
        "num_data": n,
        "weight_decay": 1.0 / n,
    }

    def mlp(params: Any) -> torch.Tensor:
        w1, b1, w2, b2 = params
        return loss_of(torch.tanh(x @ w1.T + b1) @ w2.T + b2, y)

    def ensemble_chains(compiled: bool) -> Callable[[int], None]:
        """The ensemble's K chains, built once: a function running ``steps`` transitions."""
        ensemble = ParallelEnsemble.from_modules(models)
        opt = HMC(ensemble.named_parameters(), seed=0, compile=compiled, **options)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            losses = loss_of(ensemble(x), y)
            losses.sum().backward()
            return losses

        def loss_fn(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return loss_of(torch.func.functional_call(ensemble, params, (x,)), y)

        def run(steps: int) -> None:
            for _ in range(steps):
                opt.step(loss_fn=loss_fn) if compiled else opt.step(closure)

        return run

    def loop_chains(compiled: bool) -> Callable[[int], None]:
        """K single-chain optimizers, built once: each runs ``steps`` transitions in turn."""
        chains = []
        for index, model in enumerate(models):
            params = [p.detach().clone().requires_grad_() for p in model.parameters()]
            opt = HMC(params, seed=index, compile=compiled, **options)

            def closure(params: list[torch.Tensor] = params, opt: HMC = opt) -> torch.Tensor:
                opt.zero_grad()
                loss = mlp(params)
                loss.backward()
                return loss

            chains.append((opt, closure))

        def run(steps: int) -> None:
            for opt, closure in chains:
                for _ in range(steps):
                    opt.step(loss_fn=mlp) if compiled else opt.step(closure)

        return run

    runs = {
        "ensemble": ensemble_chains(False),
        "loop": loop_chains(False),
        "ensemble_compiled": ensemble_chains(True),
        "loop_compiled": loop_chains(True),
    }
    for run in runs.values():  # compiles (excluded from the timings) and warms up
        run(2)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run(draws)
            times[name].append(time.perf_counter() - started)

    def speedup(fast: str, slow: str) -> float:
        return statistics.median(b / a for a, b in zip(times[fast], times[slow], strict=True))

    out = {f"{name}_s": statistics.median(values) for name, values in times.items()}
    out["speedup"] = speedup("ensemble", "loop")
    out["speedup_compiled"] = speedup("ensemble_compiled", "loop_compiled")
    out["speedup_compiled_vs_eager_loop"] = speedup("ensemble_compiled", "loop")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", choices=["all", "ess", "ensemble"], default="all")
    parser.add_argument("--problem", choices=["all", "logreg", "mlp"], default="all")
    parser.add_argument("--rounds", type=int, default=None, help="(default: 3, 1 with --quick)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    draws = 100 if args.quick else 300
    rounds = args.rounds or (1 if args.quick else 3)
    results: dict[str, Any] = {}
    problems = ("logreg", "mlp") if args.problem == "all" else (args.problem,)
    for name in problems if args.part in ("all", "ess") else ():
        results[name] = compare(Problem(name), draws if name == "logreg" else draws // 2, rounds)
        print(f"\n{name}:")
        for key, value in results[name].items():
            if isinstance(value, dict):
                print(f"  {key:9s} " + "  ".join(f"{k} {v:.4g}" for k, v in value.items()))
            else:
                print(f"  {key}: {value:.3f}")
    for data in ("digits", "cancer") if args.part in ("all", "ensemble") else ():
        e = results[f"ensemble_{data}"] = ensemble_vs_loop(
            draws=20 if args.quick else 60, rounds=rounds, data=data
        )
        print(
            f"\nK = 16 MLP chains ({data}): closure: ensemble {e['ensemble_s']:.2f} s, loop "
            f"{e['loop_s']:.2f} s, speed-up {e['speedup']:.2f}x; compiled: ensemble "
            f"{e['ensemble_compiled_s']:.2f} s, loop {e['loop_compiled_s']:.2f} s, speed-up "
            f"{e['speedup_compiled']:.2f}x; compiled ensemble vs closure loop "
            f"{e['speedup_compiled_vs_eager_loop']:.2f}x"
        )
    return results


if __name__ == "__main__":
    main()
