r"""Batch sums of per-example curvature (GGN or empirical Fisher), diagonal or dense.

Both curvatures are sums of outer products of per-example "pseudo-gradients". With
:math:`f_i` the model output for example i (flattened to O numbers), :math:`J_i =
\partial f_i / \partial\theta` and a factor :math:`V_i \in \mathbb{R}^{O\times K}` from
the likelihood (:mod:`._likelihoods`),

.. math::

    C = \sum_i \sum_{k=1}^{K} g_{ik} g_{ik}^\top, \qquad g_{ik} = J_i^\top v_{ik},

where :math:`V_i = \nabla_f \ell_i` (K = 1) gives the empirical Fisher
:math:`\sum_i \nabla\ell_i \nabla\ell_i^\top` and :math:`V_i V_i^\top = \nabla_f^2\ell_i`
gives the GGN :math:`\sum_i J_i^\top H_i J_i`.

**Diagonal, fast path** (``nn.Linear`` called once per forward on a ``(batch, in)``
input, and ``nn.Conv2d`` with ``groups=1``, zero padding, on a 4-d input). For a linear
layer :math:`z_i = W a_i + b` the pseudo-gradient of W is :math:`G_{ik} a_i^\top` with
:math:`G_{ik} = \partial (f_i \cdot v_{ik}) / \partial z_i`, so

.. math::

    \mathrm{diag}_W = \Big(\sum_k G_k \circ G_k\Big)^\top (A \circ A), \qquad
    \mathrm{diag}_b = \sum_{i,k} G_{ik} \circ G_{ik},

with A (batch, in) captured by a forward hook and all K matrices :math:`G_k` (batch, out)
from ONE backward of the batch output, vmapped over the K columns
(``torch.autograd.grad(..., is_grads_batched=True)``) and taken with respect to the layer
outputs only, so no weight gradient and no per-example gradient is ever formed. Memory
beyond a forward pass: the K output gradients of each layer. A convolution shares its
weight across positions, and so does a Linear layer on a ``(batch, *positions, in)``
input (a transformer's), so the square cannot move inside the sum; there the
per-example gradients :math:`G_{ik} U_i^\top` (U: the unfolded input, or the positions'
inputs) are formed one chunk of examples at a time, for that layer only.

**Outputs with positions** (``(batch, *positions, classes)``): the factor is block
diagonal, one block per output position (:mod:`~samplers_as_optim.gaussian.likelihoods`):
T·K columns, and every sum here is :math:`\sum_t J_{it}^\top H_{it}J_{it}` exactly,
even through a model that mixes the positions. The backward passes take whole
positions' columns in chunks of at most ``_CHUNK_BYTES``; the generic path forms the
block-diagonal factor of a chunk of examples only.

**Everything else** (other modules, shared weights, a layer called twice) goes through
the generic path: for a chunk of examples, ``vmap`` over examples of ``vjp`` of the
model output, ``vmap``-ed over the K columns, with respect to those parameters only;
dense curvature accumulates :math:`R^\top R` over chunks of rows (one Linear layer has
its own exact path, :class:`DenseSum`). Both give the same numbers; the tests check it.

Examples must not interact (batch norm in training mode would make them): the wrappers
run the model in eval mode while computing curvature.

**Bad data.** Every path runs the batch through
:func:`~samplers_as_optim.gaussian._data_checks.checked_forward`, which refuses
(``ValueError``) a batch whose inputs, targets or outputs hold NaN or ±inf, or whose
targets the likelihood refuses (a class index out of range, which the GGN would not
notice); ``check_finite_curvature`` refuses an overflowed sum where the sums are complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from ._data_checks import check_finite_batch, check_finite_curvature, checked_forward
from .flat import Treated
from .likelihoods import Likelihood, block_diagonal, factor_blocks, factor_columns

__all__ = [
    "DenseSum",
    "batch_factor",
    "check_finite_batch",
    "check_finite_curvature",
    "dense_curvature",
    "diag_curvature",
]

# Bytes of per-example gradients held at once by the generic path and the conv path.
_CHUNK_BYTES = 2**27


def batch_factor(likelihood: Likelihood, kind: str, output: Tensor, target: Tensor) -> Tensor:
    """``V`` of shape (B, O, K): output gradients (``"ef"``) or Hessian factors (``"ggn"``).

    For an output with T positions (``likelihood.positions``) both are block diagonal,
    one block per position (:func:`~samplers_as_optim.gaussian.likelihoods.factor_blocks`):
    K = T for the empirical Fisher, T times the classes for the GGN of a softmax.
    """
    return _example_factors(factor_blocks(likelihood, kind, output, target))


def _example_factors(blocks: Tensor) -> Tensor:
    """The (b, O, K) factors of a run of examples from their (b, T, O_t, K_t) blocks."""
    return blocks[:, 0] if blocks.shape[1] == 1 else block_diagonal(blocks)


def _rows_per_chunk(row_bytes: int) -> int:
    return max(1, _CHUNK_BYTES // max(row_bytes, 1))


def fast_layers(model: nn.Module, names: Iterable[str]) -> dict[nn.Module, dict[str, str]]:
    """Linear/Conv2d modules owning treated, unshared weights: module -> {local: full name}."""
    wanted = set(names)
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    layers: dict[nn.Module, dict[str, str]] = {}
    for prefix, module in model.named_modules():
        forward = type(module).forward
        if forward is nn.Conv2d.forward:
            if (
                module.groups != 1
                or module.padding_mode != "zeros"
                or isinstance(module.padding, str)
            ):
                continue
        elif forward is not nn.Linear.forward:
            continue
        entries = {}
        for local in ("weight", "bias"):
            full = f"{prefix}.{local}" if prefix else local
            param = module._parameters.get(local)
            if param is not None and full in wanted and owners.get(id(param)) == 1:
                entries[local] = full
        if entries:
            layers[module] = entries
    return layers


@contextmanager
def capture_layer_io(
    layers: Iterable[nn.Module],
) -> Iterator[dict[nn.Module, list[tuple[Any, int, Tensor]]]]:
    """Record (input, input version, output) of every call; hand a clone downstream.

    The clone keeps the recorded output intact if a later operation works in place (an
    in-place ReLU would otherwise turn it into the ReLU's output).
    """
    records: dict[nn.Module, list[tuple[Any, int, Tensor]]] = {}

    def hook(module: nn.Module, args: tuple[object, ...], output: Tensor) -> Tensor:
        first = args[0] if args else None
        version = first._version if isinstance(first, Tensor) else -1
        records.setdefault(module, []).append((first, version, output))
        return output.clone() if isinstance(output, Tensor) else output

    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def recorded_input(calls: list[tuple[Any, int, Tensor]], batch: int) -> Tensor | None:
    """The input of a layer's recorded calls, if the fast paths can use them (else None).

    Usable: one call (see :func:`capture_layer_io`), on a tensor with the batch first
    that no operation has changed in place since, and an output in the autograd graph.
    """
    if len(calls) != 1:
        return None
    inp, version, out = calls[0]
    if not isinstance(inp, Tensor) or not isinstance(out, Tensor):
        return None
    if inp._version != version or out.grad_fn is None or inp.shape[:1] != (batch,):
        return None
    return inp


def layer_output_grads(
    output: Tensor, columns: Tensor, layer_outputs: list[Tensor], *, retain_graph: bool = False
) -> list[Tensor]:
    """The gradients of K factor columns with respect to each layer output.

    One batched backward from ``output`` with ``columns`` (K, B, O) as its K cotangents;
    each result is (K, *layer_output.shape), zeros for a layer ``output`` does not use.
    """
    if not layer_outputs:
        return []
    count = columns.shape[0]
    grad_outputs = columns.reshape(count, *output.shape)
    grads = torch.autograd.grad(
        output,
        layer_outputs,
        grad_outputs if count > 1 else grad_outputs[0],
        is_grads_batched=count > 1,
        allow_unused=True,
        retain_graph=retain_graph,
    )
    result = []
    for layer_out, grad in zip(layer_outputs, grads, strict=True):
        if grad is None:
            grad = layer_out.new_zeros(count, *layer_out.shape)
        elif count == 1:
            grad = grad.unsqueeze(0)
        result.append(grad)
    return result


def layer_grad_chunks(
    output: Tensor, blocks: Tensor, layer_outputs: list[Tensor]
) -> Iterator[list[Tensor]]:
    """:func:`layer_output_grads` of all the factor's columns, a chunk of them at a time.

    ``blocks``: the factor per position (``likelihoods.factor_blocks``). One chunk of all
    K columns without positions; with T positions, whole positions' columns, at most
    ``_CHUNK_BYTES`` of cotangents and layer gradients at once.
    """
    if not layer_outputs:
        return
    positions = blocks.shape[1]
    numbers = output.numel() + sum(layer.numel() for layer in layer_outputs)
    most = _rows_per_chunk(numbers * output.element_size())
    for columns in factor_columns(blocks, most):
        yield layer_output_grads(output, columns, layer_outputs, retain_graph=positions > 1)


def _usable(
    module: nn.Module, calls: list[tuple[Any, int, Tensor]], batch: int, shared: bool = False
) -> bool:
    """One usable call (:func:`recorded_input`), on an input the fast paths take.

    A (batch, in) input for a Linear layer (``shared``: or (batch, *positions, in)), a
    4-d one for a convolution.
    """
    inp = recorded_input(calls, batch)
    if inp is None:
        return False
    if isinstance(module, nn.Linear):
        return inp.dim() == 2 or (shared and inp.dim() > 2)
    return inp.dim() == 4


def _linear_diag(
    inp: Tensor, grads: Tensor, entries: dict[str, str], out: dict[str, Tensor]
) -> None:
    """``grads``: (K, B, out). Adds the weight/bias diagonals into ``out``."""
    summed = grads.square().sum(0)
    if "weight" in entries:
        _add(out, entries["weight"], summed.transpose(0, 1) @ inp.detach().square())
    if "bias" in entries:
        _add(out, entries["bias"], summed.sum(0))


def _add(out: dict[str, Tensor], name: str, value: Tensor) -> None:
    """``out[name] += value`` (a chunk of the factor's columns), or the first value."""
    out[name] = value if name not in out else out[name] + value


def unfold_input(module: nn.Conv2d, inp: Tensor) -> Tensor:
    """The patches a convolution's kernel sees, (B, C_in*kh*kw, L), detached (``F.unfold``)."""
    return F.unfold(
        inp.detach(),
        module.kernel_size,
        dilation=module.dilation,
        # fast_layers excludes string padding, so this is the int tuple.
        padding=cast(tuple[int, ...], module.padding),
        stride=module.stride,
    )


def _shared_diag(
    module: nn.Module, inp: Tensor, grads: Tensor, entries: dict[str, str], out: dict[str, Tensor]
) -> None:
    r"""A weight shared over L positions: per-example gradients, a chunk of examples at a time.

    A convolution (``grads`` (K, B, C_out, H, W), its unfolded input) or a Linear layer on
    ``(B, *positions, in)`` (``grads`` (K, B, *positions, out)): the diagonal of
    :math:`\sum_{i,k} g_{ik}g_{ik}^\top` with :math:`g_{ik} = \sum_l G_{ikl}u_{il}^\top`.
    """
    k, batch = grads.shape[:2]
    if isinstance(module, nn.Conv2d):
        grads = grads.reshape(k, batch, grads.shape[2], -1)
        unfolded = unfold_input(module, inp) if "weight" in entries else None
    else:
        grads = grads.reshape(k, batch, -1, grads.shape[-1]).transpose(2, 3)
        unfolded = inp.detach().reshape(batch, -1, inp.shape[-1]).transpose(1, 2)
    channels = grads.shape[2]
    if "bias" in entries:
        _add(out, entries["bias"], grads.sum(-1).square().sum((0, 1)))
    if unfolded is None or "weight" not in entries:
        return
    weight = cast(Tensor, module.weight)
    total = torch.zeros(channels, unfolded.shape[1], dtype=weight.dtype, device=weight.device)
    step = _rows_per_chunk(k * weight.numel() * weight.element_size())
    for start in range(0, batch, step):
        per_example = torch.einsum(
            "kbol,bjl->kboj", grads[:, start : start + step], unfolded[start : start + step]
        )
        total += per_example.square().sum((0, 1))
    _add(out, entries["weight"], total.reshape(weight.shape))


def _per_example_vjp(
    model: nn.Module, params: dict[str, Tensor]
) -> Callable[[Tensor, Tensor], dict[str, Tensor]]:
    """``(x_i, V_i) -> {name: (K, *shape)}``: the K pseudo-gradients of one example."""

    def run(xi: Tensor, vi: Tensor) -> dict[str, Tensor]:
        def output(p: dict[str, Tensor]) -> Tensor:
            return cast(Tensor, functional_call(model, p, (xi.unsqueeze(0),))).reshape(-1)

        # vjp without has_aux returns a pair; its stub's union also admits the triple.
        _, pullback = vjp(output, params)  # type: ignore[misc]
        (grads,) = vmap(pullback)(vi.transpose(0, 1))
        return cast(dict[str, Tensor], grads)

    return run


def _example_bytes(blocks: Tensor, numel: int, itemsize: int) -> int:
    """Bytes per example of the generic path: K pseudo-gradients (and a formed factor)."""
    positions, rows, width = blocks.shape[1:]
    formed = positions * rows if positions > 1 else 0  # the block-diagonal factor's rows
    return positions * width * (numel + formed) * itemsize


def _pseudo_gradient_chunks(
    model: nn.Module, params: dict[str, Tensor], x: Tensor, blocks: Tensor
) -> Iterator[dict[str, Tensor]]:
    """The generic path's ``{name: (b, K, *shape)}`` at ``params``, b examples at a time."""
    run = _per_example_vjp(model, params)
    numel = sum(p.numel() for p in params.values())
    itemsize = next(iter(params.values())).element_size()
    step = _rows_per_chunk(_example_bytes(blocks, numel, itemsize))
    for start in range(0, x.shape[0], step):
        factor = _example_factors(blocks[start : start + step])
        # torch.func transforms ignore an outer no_grad; it only stops the module's other
        # parameters from recording history into the results.
        with torch.no_grad():
            grads = vmap(run)(x[start : start + step], factor)
        yield grads


def _generic_diag(
    model: nn.Module, names: list[str], x: Tensor, blocks: Tensor, out: dict[str, Tensor]
) -> None:
    current = dict(model.named_parameters())
    params = {name: current[name].detach() for name in names}
    totals = {name: torch.zeros_like(p) for name, p in params.items()}
    for grads in _pseudo_gradient_chunks(model, params, x, blocks):
        for name in names:
            totals[name] += grads[name].square().sum((0, 1))
    out.update(totals)


def diag_curvature(
    model: nn.Module,
    treated: Treated,
    x: Tensor,
    target: Tensor,
    likelihood: Likelihood,
    kind: str,
    *,
    fast: bool = True,
) -> dict[str, Tensor]:
    r"""Diagonal of the curvature summed over the batch, for the treated parameters.

    Args:
        model: the network (in eval mode).
        treated: the parameters to compute it for.
        x: a batch of inputs, examples along dimension 0.
        target: the batch's targets.
        likelihood: the per-example likelihood.
        kind: ``"ggn"`` or ``"ef"``.
        fast: use the Linear/Conv2d fast path where it applies (False: generic path for
            every parameter; for testing).

    Returns:
        name -> tensor of the parameter's shape: :math:`\sum_i \mathrm{diag}(C_i)`.
    """
    layers = fast_layers(model, treated.names) if fast else {}
    batch = x.shape[0]
    out: dict[str, Tensor] = {}
    with capture_layer_io(layers) as records, torch.set_grad_enabled(bool(layers)):
        output = checked_forward(model, x, target, likelihood)
    blocks = factor_blocks(likelihood, kind, output.detach(), target)
    usable = {
        module: entries
        for module, entries in layers.items()
        if _usable(module, records.get(module, []), batch, shared=True)
    }
    outputs = [records[module][0][2] for module in usable]
    for grads in layer_grad_chunks(output, blocks, outputs):
        for (module, entries), grad in zip(usable.items(), grads, strict=True):
            inp = records[module][0][0]
            if isinstance(module, nn.Linear) and inp.dim() == 2:
                _linear_diag(inp, grad, entries, out)
            else:
                _shared_diag(module, inp, grad, entries, out)
    del records, output, outputs
    rest = [name for name in treated.names if name not in out]
    if rest:
        _generic_diag(model, rest, x, blocks, out)
    return {name: out[name] for name in treated.names}


def _single_linear(model: nn.Module, treated: Treated) -> tuple[nn.Linear, dict[str, str]] | None:
    """The one ``nn.Linear`` layer owning every treated parameter, if that is the case."""
    layers = fast_layers(model, treated.names)
    if len(layers) != 1:
        return None
    module, entries = next(iter(layers.items()))
    if not isinstance(module, nn.Linear) or set(entries.values()) != set(treated.names):
        return None
    return module, entries


def _linear_dense_sum(
    model: nn.Module,
    module: nn.Linear,
    entries: dict[str, str],
    x: Tensor,
    target: Tensor,
    likelihood: Likelihood,
    kind: str,
) -> Tensor | None:
    r"""Dense curvature of one Linear layer: :math:`\sum_i M_i\otimes\tilde a_i\tilde a_i^\top`.

    :math:`M_i = \sum_k g_{ik}g_{ik}^\top` from the K output gradients of the layer
    (one batched backward), :math:`\tilde a_i = [a_i; 1]`; the sum over examples is one
    matrix product :math:`M^\top (\tilde A\odot\tilde A)` per chunk of examples, in
    :math:`O(B\,d_\text{out}^2 d_\text{in}^2)` instead of the
    :math:`O(BK\,d_\text{out}^2 d_\text{in}^2)` of forming the rows, and on the upper
    triangles of both factors only. Returns that (out(out+1)/2, w(w+1)/2) triangle (see
    :func:`_expand_linear_dense`), or None when the layer is not called once on a
    (batch, in) input (the generic path then applies).
    """
    batch = x.shape[0]
    with capture_layer_io([module]) as records, torch.set_grad_enabled(True):
        output = checked_forward(model, x, target, likelihood)
    if not _usable(module, records.get(module, []), batch):
        return None
    blocks = factor_blocks(likelihood, kind, output.detach(), target)
    inp, _, layer_out = records[module][0]
    out_features = layer_out.shape[-1]
    # M_i and a~_i a~_i^T are symmetric: only their upper triangles enter the product.
    upper_out = torch.triu_indices(out_features, out_features, device=layer_out.device)
    m = layer_out.new_zeros(0)
    for (grads,) in layer_grad_chunks(output, blocks, [layer_out]):
        grads = grads.detach()
        part = torch.einsum("kbo,kbp->bop", grads, grads)[:, upper_out[0], upper_out[1]]
        m = part if m.numel() == 0 else m + part
    del records, output
    parts = [inp.detach()] if "weight" in entries else []
    if "bias" in entries:
        parts.append(m.new_ones(batch, 1))
    augmented = torch.cat(parts, dim=1)
    width = augmented.shape[1]
    upper_in = torch.triu_indices(width, width, device=m.device)
    total = m.new_zeros(m.shape[1], upper_in.shape[1])
    step = _rows_per_chunk(upper_in.shape[1] * augmented.element_size())
    for start in range(0, batch, step):
        chunk = augmented[start : start + step]
        outer = chunk[:, upper_in[0]] * chunk[:, upper_in[1]]
        total += m[start : start + step].T @ outer
    return total


def _expand_linear_dense(
    total: Tensor, treated: Treated, module: nn.Linear, entries: dict[str, str]
) -> Tensor:
    """The (P, P) matrix in the treated flat order from :func:`_linear_dense_sum`'s triangle."""
    out_features = module.out_features
    width = (module.in_features if "weight" in entries else 0) + ("bias" in entries)
    upper_out = torch.triu_indices(out_features, out_features, device=total.device)
    upper_in = torch.triu_indices(width, width, device=total.device)
    blocks = total.new_empty(total.shape[0], width, width)
    blocks[:, upper_in[0], upper_in[1]] = total
    blocks[:, upper_in[1], upper_in[0]] = total
    full = total.new_empty(out_features, out_features, width, width)
    full[upper_out[0], upper_out[1]] = blocks
    full[upper_out[1], upper_out[0]] = blocks
    block = full.permute(0, 2, 1, 3).reshape(out_features * width, out_features * width)
    # row-major vec([W, b]) -> the treated flat order (weight entries, then the bias)
    starts = [0, *torch.tensor(treated.sizes).cumsum(0).tolist()]
    offsets = dict(zip(treated.names, starts[:-1], strict=True))
    positions = torch.empty(out_features, width, dtype=torch.long)
    rows = torch.arange(out_features).unsqueeze(1)
    if "weight" in entries:
        in_features = module.in_features
        positions[:, :in_features] = (
            offsets[entries["weight"]] + rows * in_features + torch.arange(in_features)
        )
    if "bias" in entries:
        positions[:, -1] = offsets[entries["bias"]] + rows[:, 0]
    order = torch.argsort(positions.reshape(-1)).to(block.device)
    return block[order][:, order]


class DenseSum:
    r"""Accumulates the dense curvature :math:`\sum_{i,k} g_{ik}g_{ik}^\top` over batches.

    When the treated parameters are exactly one ``nn.Linear`` layer's (a last-layer
    Laplace) the Kronecker structure of its per-example curvature gives a fast exact path
    whose triangle is summed over the batches and expanded once (``fast=False`` forces
    the generic path, for testing).
    """

    def __init__(
        self,
        model: nn.Module,
        treated: Treated,
        likelihood: Likelihood,
        kind: str,
        *,
        fast: bool = True,
    ) -> None:
        self.model, self.treated, self.likelihood, self.kind = model, treated, likelihood, kind
        self.single = _single_linear(model, treated) if fast else None
        self.triangle: Tensor | None = None
        self.generic: Tensor | None = None

    def add(self, x: Tensor, target: Tensor) -> None:
        """Add one batch's curvature."""
        if self.single is not None:
            part = _linear_dense_sum(
                self.model, *self.single, x, target, self.likelihood, self.kind
            )
            if part is not None:
                self.triangle = part if self.triangle is None else self.triangle + part
                return
        part = _generic_dense(self.model, self.treated, x, target, self.likelihood, self.kind)
        self.generic = part if self.generic is None else self.generic + part

    def result(self, like: Tensor) -> Tensor:
        """The (P, P) sum (zeros shaped and typed after ``like``'s device/dtype if empty)."""
        size = self.treated.numel
        total = (
            self.generic
            if self.generic is not None
            else torch.zeros(size, size, dtype=like.dtype, device=like.device)
        )
        if self.triangle is not None:
            assert self.single is not None
            total = total + _expand_linear_dense(self.triangle, self.treated, *self.single)
        return total


def dense_curvature(
    model: nn.Module,
    treated: Treated,
    x: Tensor,
    target: Tensor,
    likelihood: Likelihood,
    kind: str,
    *,
    fast: bool = True,
) -> Tensor:
    r"""Dense curvature :math:`\sum_{i,k} g_{ik} g_{ik}^\top` over the batch, shape (P, P).

    The flat order is that of ``treated`` (``model.named_parameters()``); see
    :class:`DenseSum` for the fast path of a single Linear layer.
    """
    accumulator = DenseSum(model, treated, likelihood, kind, fast=fast)
    accumulator.add(x, target)
    reference = dict(model.named_parameters())[treated.names[0]]
    return accumulator.result(reference)


def _generic_dense(
    model: nn.Module,
    treated: Treated,
    x: Tensor,
    target: Tensor,
    likelihood: Likelihood,
    kind: str,
) -> Tensor:
    """Per-example ``vmap(vjp)`` rows, a chunk of examples at a time: sum of R^T R."""
    with torch.no_grad():
        output = checked_forward(model, x, target, likelihood)
    blocks = factor_blocks(likelihood, kind, output, target)
    current = dict(model.named_parameters())
    params = {name: current[name].detach() for name in treated.names}
    reference = params[treated.names[0]]
    total = torch.zeros(
        treated.numel, treated.numel, dtype=reference.dtype, device=reference.device
    )
    for grads in _pseudo_gradient_chunks(model, params, x, blocks):
        rows = treated.flatten(grads, batch_dims=2).reshape(-1, treated.numel)
        total += rows.transpose(0, 1) @ rows
    return total
