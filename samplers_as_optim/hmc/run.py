r"""Many HMC transitions in one call: ``HMC.run(loss_fn, num_draws)``, the draws and diagnostics.

``HMC.step`` is one transition per call, and a call costs more than its arithmetic: the
random numbers, the bookkeeping of a step that may raise, and with ``compile=True`` the
entry into the compiled graph (guards, wrappers), all once per transition. For a small
model that is most of the time. ``HMC.run`` makes ``num_draws * thin`` transitions in one
call, as BlackJAX's ``jax.lax.scan`` over its kernel does, and returns the draws:

1. the random numbers of a chunk of up to :data:`CHUNK` consecutive transitions are drawn
   at once (``transition_draws.draw_transitions``: for each transition exactly the numbers
   ``step`` draws at that step, stacked);
2. with ``compile=True`` the chunk runs as **one compiled region**: a
   ``torch._higher_order_ops.while_loop`` whose body is :func:`~._functional.transition`
   (the function ``step(loss_fn=...)`` compiles) on the chunk's row of numbers, recording
   each state, loss and diagnostics into preallocated buffers; the number of transitions
   is a tensor, so a chunk of any length up to :data:`CHUNK` is the same graph (one
   compilation per model and hyperparameters). Without ``compile`` the same transitions run
   eagerly in a Python loop;
3. the kept draws (every ``thin``-th state) are copied into the result, and after the last
   chunk the optimizer is left exactly as ``num_draws * thin`` calls of
   ``step(loss_fn=...)`` leave it: the parameters and their ``.grad``, the step counters,
   the noise keys, the diagnostics and the start of the next step (so ``state_dict()``
   and further steps continue the same chain).

The same chain. Each transition takes the numbers ``step`` draws at its step counter and
evaluates the function ``step(loss_fn=...)`` evaluates, :func:`~._functional.transition`.
Eagerly it is the very same call on the same numbers. Compiled, the loop's body is that
function traced once more (plus reading its row of numbers and writing its records) and
compiled by inductor as a subgraph of its own, the step's graph being the function
compiled alone: the same ops on the same inputs, hence the same arithmetic as long as
inductor generates the same code for them. The tests check that bit for bit against
repeated ``step`` calls (the draws, the diagnostics, the optimizer afterwards and a resume;
one chain and stacked chains, eagerly and compiled: ``tests/test_hmc_run.py``). If
``torch.compile`` cannot capture the loss function inside the loop (a graph break in the
body), ``run`` warns once and calls the step's compiled transition once per transition
instead: the same chain by construction, without the saving.

Warm-up. Adaptation changes the step size (and collects the mass) after every
transition, in Python; during the warm-up ``run`` therefore makes its transitions by
calling ``step(loss_fn=...)``, one at a time, and records them (the same chain, with the
same adaptation; nothing is saved). Run the warm-up (:meth:`HMC.warmup`) first for the
fast path.

A run is all or nothing, as a step is: if it raises (a failing loss function, an
interrupt), the optimizer, the parameters and their gradients are left as before the run.

Devices. The code is device generic: on a GPU the chunk is one compiled region too (the
loop's condition read by the host once per transition); it has not run on a GPU yet, and
a CUDA-graph capture of the chunk (no host round trip at all) is not implemented.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from ..core.progress import ProgressBar, check_progress
from ..core.streams import NoiseStream
from ..core.validation import check_positive_int
from . import _functional
from .arguments import check_loss_fn
from .rollback import Rollback
from .start import TransitionStart
from .transition_draws import TransitionDraws, draw_transitions

__all__ = ["CHUNK", "CHUNK_ELEMENTS", "HMCRun", "chain_chunk", "chunk_capacity", "run_chain"]

#: the most transitions one compiled call makes (the stacked random numbers' length)
CHUNK = 64
#: a chunk's stacked momenta and recorded states hold at most this many elements each
#: (so ``min(CHUNK, CHUNK_ELEMENTS // parameters)`` transitions, at least one): the compiled
#: loop copies its record buffers once per transition (a loop's carried state is not
#: written in place), so this bounds that copy too
CHUNK_ELEMENTS = 2**18
#: the diagnostics recorded per transition (``HMC.diagnostics``' entries) and their dtypes
RECORDED: dict[str, torch.dtype] = {
    "accept_prob": torch.float64,
    "accepted": torch.bool,
    "energy_error": torch.float64,
    "divergent": torch.bool,
    "step_size": torch.float64,
    "num_accepted": torch.int64,
    "divergences": torch.int64,
}
_NOT_CAPTURED = (
    "HMC.run: torch.compile cannot capture this loss_fn inside one compiled loop ({error}); "
    "running the compiled transition of step(loss_fn=...) once per transition instead (the "
    "same chain, without the saving of the loop)"
)


#: the loss functions (by code, as ``_functional.compiled_copy`` keys them) whose loop
#: ``torch.compile`` could not capture in one graph, per device type: warned once, then
#: run by the compiled transition
_UNCAPTURED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


class HMCRun(NamedTuple):
    """What :meth:`HMC.run <samplers_as_optim.HMC.run>` returns: the draws and per-draw diagnostics.

    Draw ``i`` is the chain's state after ``(i + 1) * thin`` transitions of the run.
    """

    #: the draws of every sampled parameter (``requires_grad``), ``[num_draws, *shape]``,
    #: by name when the optimizer knows every parameter's name (as ``loss_fn`` receives
    #: them), else by position among the optimizer's parameters (``"0"``, ``"1"``, ...):
    #: the package's stacked layout (``call_stacked``); for a ``ParallelEnsemble`` each
    #: draw holds the K members, ``[num_draws, K, ...]``
    samples: dict[str, Tensor]
    #: the mean loss at each draw, ``[num_draws]`` (``[num_draws, K]`` for K members)
    loss: Tensor
    #: ``HMC.diagnostics`` after the transition that made each draw, each ``[num_draws]``
    #: (``[num_draws, K]``): ``accept_prob``, ``accepted``, ``energy_error``,
    #: ``divergent``, ``step_size`` and the running counts ``num_accepted`` and
    #: ``divergences`` (which count every transition, kept or thinned out)
    diagnostics: dict[str, Tensor]

    def chains(self) -> dict[str, Tensor]:
        """The samples laid out ``[chains, draws, *shape]``, for ``samplers_as_optim.diagnostics``.

        One chain (``[1, num_draws, *shape]``), or the K members of a ``ParallelEnsemble``
        (``[K, num_draws, ...]``, a view).
        """
        if self.loss.dim() == 1:
            return {name: value.unsqueeze(0) for name, value in self.samples.items()}
        return {name: value.transpose(0, 1) for name, value in self.samples.items()}


class _Chain(Protocol):
    """What :func:`run_chain` uses of an ``HMC`` optimizer (its chain and its step)."""

    param_groups: list[dict[str, Any]]
    state: Any
    _next: TransitionStart

    @property
    def _hmc_state(self) -> dict[str, Any]: ...

    def _params(self) -> list[Tensor]: ...

    def _check_groups(self) -> None: ...

    def _noise_keys(self, params: list[Tensor]) -> list[int]: ...

    def _stream(self, seed: int) -> NoiseStream: ...

    def _record_noise_keys(self, params: list[Tensor]) -> None: ...

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        loss_fn: Callable[[Any], Tensor] | None = None,
    ) -> Tensor: ...


class _Chunk(NamedTuple):
    """What a chunk of transitions returns (rows from ``count`` on are zeros)."""

    positions: list[Tensor]  #: the chain's state after the last transition
    gradients: list[Tensor]  #: the mean loss's gradient there
    loss: Tensor  #: the mean loss there
    records: list[Tensor]  #: each transition's state, ``[capacity, *shape]``
    losses: Tensor  #: each transition's loss, ``[capacity(, K)]``
    diagnostics: dict[str, Tensor]  #: each transition's diagnostics (``RECORDED``)


def _row(stacked: Tensor, t: Tensor) -> Tensor:
    """Row ``t`` (a 0-d int64 tensor) of ``stacked``, without a data-dependent shape."""
    return stacked.index_select(0, t.view(1)).squeeze(0)


def chain_chunk(
    loss_fn: Callable[[Any], Any],
    names: Sequence[str] | None,
    positions: Sequence[Tensor],
    gradients: Sequence[Tensor],
    loss: Tensor,
    momenta: Sequence[Tensor],
    uniform: Tensor,
    multiplier: Tensor,
    step_size: Tensor,
    root_lr: Sequence[float],
    inverse_mass: Sequence[Tensor | None],
    decays: Sequence[float],
    num_accepted: Tensor,
    divergences: Tensor,
    fixed: Sequence[Tensor | None] | None,
    count: Tensor,
    *,
    num_data: int,
    temperature: float,
    num_steps: int,
    members: int | None,
) -> _Chunk:
    """``count`` transitions from ``positions`` in one ``while_loop`` (what ``run`` compiles).

    Transition ``t`` is :func:`~._functional.transition` with row ``t`` of the stacked
    ``momenta``, ``uniform``, ``multiplier`` and ``step_size`` (``transition_draws.
    draw_transitions``); ``count`` (a 0-d int64 tensor, at most their length) is an input,
    so chunks of every length are one graph. The other arguments are
    :func:`~._functional.transition`'s. Nothing given is modified.
    """
    capacity, size = uniform.shape[0], len(positions)
    records, losses, diagnostics = _record_buffers(positions, loss, capacity)
    body = _loop_body(
        loss_fn,
        names,
        (momenta, uniform, multiplier, step_size),
        (root_lr, inverse_mass, decays, fixed),
        num_data=num_data,
        temperature=temperature,
        num_steps=num_steps,
        members=members,
    )

    def cond(t: Tensor, *carried: Tensor) -> Tensor:
        return t < count

    from torch._higher_order_ops import while_loop  # (imports dynamo: on first use)

    start = torch.zeros((), dtype=torch.int64, device=count.device)
    carried = (start, *positions, *gradients, loss, num_accepted, divergences)
    recorded = (*records, losses, *diagnostics.values())
    out: tuple[Tensor, ...] = while_loop(  # type: ignore[no-untyped-call]
        cond, body, (*carried, *recorded)
    )
    kept = out[2 * size + 4 :]
    return _Chunk(
        positions=list(out[1 : size + 1]),
        gradients=list(out[size + 1 : 2 * size + 1]),
        loss=out[2 * size + 1],
        records=list(kept[:size]),
        losses=kept[size],
        diagnostics=dict(zip(RECORDED, kept[size + 1 :], strict=True)),
    )


def _record_buffers(
    positions: Sequence[Tensor], loss: Tensor, rows: int
) -> tuple[list[Tensor], Tensor, dict[str, Tensor]]:
    """Zeros for ``rows`` transitions' records: states, losses and ``RECORDED`` diagnostics."""
    shape = (rows, *loss.shape)
    records = [p.new_zeros((rows, *p.shape)) for p in positions]
    losses = loss.new_zeros(shape)
    diagnostics = {
        key: torch.zeros(shape, dtype=dtype, device=loss.device) for key, dtype in RECORDED.items()
    }
    return records, losses, diagnostics


def _loop_body(
    loss_fn: Callable[[Any], Any],
    names: Sequence[str] | None,
    stacked: tuple[Sequence[Tensor], Tensor, Tensor, Tensor],
    constants: tuple[Sequence[float], Sequence[Tensor | None], Sequence[float], Any],
    **options: Any,
) -> Callable[..., tuple[Tensor, ...]]:
    """:func:`chain_chunk`'s loop body: transition ``t`` on row ``t`` of the ``stacked`` numbers.

    ``stacked``: the momenta, uniforms, multipliers, step sizes; ``constants``: root_lr,
    inverse_mass, decays, fixed; ``options``: the keywords of :func:`~._functional.transition`.
    The body records the new state, loss and diagnostics in the loop's buffers, row ``t``.
    """
    momenta, uniform, multiplier, step_size = stacked
    root_lr, inverse_mass, decays, fixed = constants
    size = len(root_lr)

    def body(t: Tensor, *carried: Tensor) -> tuple[Tensor, ...]:
        state, gradient = list(carried[:size]), list(carried[size : 2 * size])
        current, accepted, divergent = carried[2 * size : 2 * size + 3]
        kept = carried[2 * size + 3 :]
        result = _functional.transition(
            loss_fn,
            names,
            state,
            gradient,
            current,
            [_row(r, t) for r in momenta],
            _row(uniform, t),
            _row(multiplier, t),
            root_lr,
            inverse_mass,
            decays,
            _row(step_size, t),
            accepted,
            divergent,
            fixed,
            **options,
        )
        row = t.view(1)
        new = [*result.positions, result.loss, *(result.diagnostics[key] for key in RECORDED)]
        return (
            t + 1,
            *result.positions,
            *result.gradients,
            result.loss,
            result.diagnostics["num_accepted"],
            result.diagnostics["divergences"],
            *(
                old.index_copy(0, row, value.unsqueeze(0))
                for old, value in zip(kept, new, strict=True)
            ),
        )

    return body


def _loop_chunk(
    transition: Callable[..., _functional.Transition], *args: Any, **kwargs: Any
) -> _Chunk:
    """:func:`chain_chunk`'s transitions in a Python loop, each by ``transition``.

    ``transition`` is :func:`~._functional.transition` (``compile=False``) or its compiled
    copy, the graph ``step(loss_fn=..., compile=True)`` runs (where the loop cannot be
    captured in one graph).
    """
    loss_fn, names, positions, gradients, loss, momenta, uniform, multiplier, step_size = args[:9]
    root_lr, inverse_mass, decays, accepted, divergent, fixed, count = args[9:]
    records, losses, diagnostics = _record_buffers(positions, loss, uniform.shape[0])
    for t in range(int(count)):
        result = transition(
            loss_fn,
            names,
            positions,
            gradients,
            loss,
            [r[t] for r in momenta],
            uniform[t],
            multiplier[t],
            root_lr,
            inverse_mass,
            decays,
            step_size[t],
            accepted,
            divergent,
            fixed,
            **kwargs,
        )
        positions, gradients, loss = result.positions, result.gradients, result.loss
        accepted = result.diagnostics["num_accepted"]
        divergent = result.diagnostics["divergences"]
        for record, value in zip(records, positions, strict=True):
            record[t] = value
        losses[t] = loss
        for key, value in diagnostics.items():
            value[t] = result.diagnostics[key]
    return _Chunk(list(positions), list(gradients), loss, records, losses, diagnostics)


def chunk_capacity(chain: Sequence[Tensor]) -> int:
    """The transitions per chunk for this chain (see :data:`CHUNK_ELEMENTS`)."""
    numel = sum(p.numel() for p in chain)
    return max(1, min(CHUNK, CHUNK_ELEMENTS // max(1, numel)))


def run_chain(
    optimizer: _Chain,
    loss_fn: Callable[[Any], Tensor],
    num_draws: Any,
    *,
    thin: Any = 1,
    progress: Any = None,
) -> HMCRun:
    """``HMC.run``: ``num_draws * thin`` transitions, every ``thin``-th state kept.

    ``progress`` shows a bar over the transitions (``core/progress``), advanced per
    transition during the warm-up and per chunk after it.

    Raises:
        TypeError: ``loss_fn`` is not a callable of one argument (a closure), or
            ``progress`` is not None, True or False.
        ValueError: ``num_draws`` or ``thin`` is not an integer >= 1, or what
            ``step(loss_fn=...)`` refuses.
    """
    num_draws = check_positive_int("num_draws", num_draws)
    thin = check_positive_int("thin", thin)
    check_loss_fn(loss_fn)
    show = check_progress(progress)
    optimizer._check_groups()
    groups, hmc = optimizer.param_groups, optimizer._hmc_state
    undo = Rollback(groups, optimizer.state, hmc, optimizer._next, clone_grads=False)
    undo.keep_values(optimizer._params())
    try:
        with ProgressBar(show, num_draws * thin, "HMC.run") as bar:
            if hmc["warmup"]:
                return _run_steps(optimizer, loss_fn, num_draws, thin, bar)
            return _run_chunks(optimizer, loss_fn, num_draws, thin, undo.start_valid, bar)
    except BaseException:
        undo.restore()
        raise


class _Draws:
    """The run's result, filled draw by draw."""

    def __init__(self, chain: list[Tensor], names: list[str], num_draws: int, loss: Tensor):
        records, self.loss, self.diagnostics = _record_buffers(chain, loss, num_draws)
        self.samples = dict(zip(names, records, strict=True))
        self.device = chain[0].device  # of the kept rows' indices

    def keep(self, chunk: _Chunk, done: int, count: int, thin: int) -> None:
        """Copy the draws among ``chunk``'s ``count`` transitions, ``done`` made before it."""
        # transition done + r is kept when done + r + 1 is a multiple of thin
        rows = list(range((thin - done % thin - 1) % thin, count, thin))
        if not rows:
            return
        where = torch.tensor(rows, device=self.device)
        into = torch.tensor([(done + r + 1) // thin - 1 for r in rows], device=self.device)
        for value, record in zip(self.samples.values(), chunk.records, strict=True):
            value.index_copy_(0, into, record.index_select(0, where))
        self.loss.index_copy_(0, into, chunk.losses.index_select(0, where))
        for key, value in self.diagnostics.items():
            value.index_copy_(0, into, chunk.diagnostics[key].index_select(0, where))

    def result(self) -> HMCRun:
        return HMCRun(self.samples, self.loss, self.diagnostics)


def _sample_names(optimizer: _Chain, chain: Sequence[Tensor]) -> list[str]:
    """The keys of the chain's draws: the parameters' names, else their positions."""
    params = optimizer._params()
    names = _functional.parameter_names(optimizer.param_groups)
    keys = names if names is not None else [str(i) for i in range(len(params))]
    key_of = {id(p): key for p, key in zip(params, keys, strict=True)}
    return [key_of[id(p)] for p in chain]


def _run_steps(
    optimizer: _Chain, loss_fn: Callable[[Any], Tensor], num_draws: int, thin: int, bar: ProgressBar
) -> HMCRun:
    """During the warm-up: ``step(loss_fn=...)`` per transition, recorded."""
    draws: _Draws | None = None
    chain: list[Tensor] = []
    for index in range(num_draws):
        for _ in range(thin):
            loss = optimizer.step(loss_fn=loss_fn)
            bar.update()
        if draws is None:
            end = optimizer._next.end
            assert end is not None  # (the step just left it)
            by_id = {id(p): p for p in optimizer._params()}
            chain = [by_id[i] for i in end.ids]
            draws = _Draws(chain, _sample_names(optimizer, chain), num_draws, loss)
        for value, p in zip(draws.samples.values(), chain, strict=True):
            value[index] = p
        draws.loss[index] = loss
        for key, value in draws.diagnostics.items():
            value[index] = optimizer._hmc_state["diagnostics"][key]
    assert draws is not None
    return draws.result()


def _run_chunks(
    optimizer: _Chain,
    loss_fn: Callable[[Any], Tensor],
    num_draws: int,
    thin: int,
    valid: bool,
    bar: ProgressBar,
) -> HMCRun:
    """After the warm-up: the transitions chunk by chunk, then the optimizer's new state."""
    groups, hmc = optimizer.param_groups, optimizer._hmc_state
    params = optimizer._params()
    evaluate = lambda: _functional.functional_start(loss_fn, groups)  # noqa: E731
    start = optimizer._next.take(params, loss_fn, valid=valid, evaluate=evaluate)
    chain, members = start.chain, start.members
    keys = optimizer._noise_keys(chain)
    compiled = bool(groups[0].get("compile", False))
    device = chain[0].device
    capacity = chunk_capacity(chain)
    total = num_draws * thin
    names = _functional.parameter_names(groups)
    fixed = _functional.frozen_parameters(groups)
    options = _functional.transition_options(groups, members)
    # the start's tensors are copied: the loop's carried state must not alias the chain
    positions = [p.detach().clone() for p in chain]
    gradients, loss = [g.clone() for g in start.gradients], start.loss.clone()
    draws = _Draws(chain, _sample_names(optimizer, chain), num_draws, loss)
    accepted = divergent = None
    last: dict[str, Tensor] = {}
    done = 0
    while done < total:
        count = min(capacity, total - done)
        numbers: TransitionDraws = draw_transitions(
            groups,
            optimizer.state,
            hmc,
            start,
            optimizer._stream,
            keys,
            offset=done,
            count=count,
            capacity=capacity if compiled else count,
        )
        if accepted is None or divergent is None:  # (copies: the loop's state is its own)
            accepted, divergent = numbers.num_accepted.clone(), numbers.divergences.clone()
        arguments = (
            loss_fn,
            names,
            positions,
            gradients,
            loss,
            *_chunk_numbers(numbers, chain),
            accepted,
            divergent,
            fixed,
            torch.tensor(count, dtype=torch.int64, device=device),
        )
        chunk = _chunk(loss_fn, device, compiled, arguments, options)
        positions, gradients, loss = chunk.positions, chunk.gradients, chunk.loss
        last = {key: value[count - 1].clone() for key, value in chunk.diagnostics.items()}
        accepted, divergent = last["num_accepted"], last["divergences"]
        draws.keep(chunk, done, count, thin)
        done += count
        bar.update(count)
    # the optimizer as `total` steps leave it (HMC.step's _finish, without adaptation)
    for p, new, g in zip(chain, positions, gradients, strict=True):
        p.copy_(new)
        p.grad = g.clone()
    hmc["diagnostics"] = last
    optimizer._record_noise_keys(chain)
    for group in groups:
        group["step"] += total
    optimizer._next.remember(params, chain, loss, list(gradients), loss_fn)
    return draws.result()


def _chunk_numbers(numbers: TransitionDraws, chain: Sequence[Tensor]) -> tuple[Any, ...]:
    """:func:`chain_chunk`'s arguments from the stacked momenta to the decays, in order."""
    return (
        numbers.momenta,
        numbers.uniform,
        numbers.multiplier,
        numbers.step_size,
        [numbers.root_lr[id(p)] for p in chain],
        numbers.inverse_mass,
        [numbers.decay[id(p)] for p in chain],
    )


def _chunk(
    loss_fn: Callable[[Any], Tensor],
    device: torch.device,
    compiled: bool,
    arguments: tuple[Any, ...],
    options: dict[str, Any],
) -> _Chunk:
    """One chunk: compiled in one region, else (or where it cannot be) in a Python loop."""
    if not compiled:
        return _loop_chunk(_functional.transition, *arguments, **options)
    from torch._dynamo.exc import UncapturedHigherOrderOpError

    failed = _UNCAPTURED.setdefault(_functional.code_key(loss_fn), set())
    if device.type not in failed:
        try:
            chunk: _Chunk = compiled_chunk(loss_fn, device)(*arguments, **options)
            return chunk
        except UncapturedHigherOrderOpError as error:  # at tracing: nothing ran
            failed.add(device.type)
            warnings.warn(_NOT_CAPTURED.format(error=_reason(error)), UserWarning, stacklevel=6)
    return _loop_chunk(_functional.compiled_transition(loss_fn, device), *arguments, **options)


def _reason(error: BaseException) -> str:
    """The gist of dynamo's refusal: its graph break and the explanation, on one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    head = lines[1] if len(lines) > 1 else lines[0]  # (line 0 says that a HOP failed)
    explained = [line for line in lines if line.startswith("Explanation:")]
    return head + (" -- " + explained[0].removeprefix("Explanation:").strip() if explained else "")


def compiled_chunk(loss_fn: Callable[[Any], Any], device: torch.device) -> Callable[..., _Chunk]:
    """:func:`chain_chunk` through ``torch.compile``, one copy per loss function's code.

    See :func:`~._functional.compiled_transition` (the same cache and options).
    """
    return _functional.compiled_copy(chain_chunk, loss_fn, device)
