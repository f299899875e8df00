r"""float16 and bfloat16 parameters: the chain's position in a float32 master copy.

A step at temperature :math:`T > 0` moves a parameter by :math:`\sqrt{2\,lr\,T/N}\,\xi`
per element; in bfloat16 (8 bits of mantissa) such an update is mostly below half an ulp
of the parameter and rounds away, so the chain freezes, quietly (SGLD, ``lr=1e-4``,
``N=1000``, 100 steps on bfloat16 ones with gradient :math:`\theta - 1`: a spread of
0.00012 against the exact 0.00445). Stochastic rounding is no cure: its rounding noise
(variance :math:`\approx \mathrm{ulp}^2/4` per step) heats the chain by orders of
magnitude. So, from a half-precision parameter's first step at :math:`T > 0` on, its
state holds ``state["master_param"]``, a float32 copy of the position:

- the step runs on the master exactly as for a float32 parameter (the gradient widened
  to float32, every buffer float32, the noise the float32 parameter's numbers), and the
  parameter then holds the master rounded to nearest (``param.copy_(master)``);
- buffers that an earlier step at :math:`T = 0` created in the parameter's dtype are
  widened to float32 when the master is created;
- at :math:`T = 0` a parameter without a master steps as ``torch.optim.SGD`` steps it
  (state in its own dtype, bit for bit torch's); one with a master keeps using it;
- the parameter wins where it was changed from outside (a user assigned it, loaded
  weights): every element whose value is not the master's rounding re-seeds the master
  from the parameter (:func:`resync_master_`: one elementwise compare, no host
  synchronisation). The compare runs only when the parameter may have changed
  (:class:`MasterSync`): when its version counter or its storage differs from what the
  last step left, which every in-place write through the parameter (``copy_`` under
  ``no_grad``, ``nn.Module.load_state_dict``, ``torch.nn.init``) and every ``param.data
  = ...`` shows; a write through ``param.data`` in place (``param.data.copy_(...)``)
  bypasses the version counter and is not seen, so the master overwrites it at the next
  step. Under ``torch.compile`` nothing is compared: inductor does not round an
  intermediate cast (``master.to(bfloat16)`` compared in float32 differs from the
  parameter almost everywhere), so a compiled compare would re-seed every master from its
  rounding each step, freezing the chain again; a value assigned between compiled steps
  is overwritten (assign ``state["master_param"]`` too).
  Measured on one CPU thread, 4M bfloat16 elements: the compare costs ~30% of an
  SGHMC step, the check of the counter nothing.

Noise keys and ``state[...]`` stay keyed by the parameter itself; only the tensors the
update computes on are substituted (:func:`compute_tensors`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ...names import member_dims, parameter_layout, set_member_dims, set_parameter_layout

__all__ = [
    "HALF_DTYPES",
    "MASTER",
    "MasterSync",
    "check_saved_master",
    "compute_tensors",
    "is_half",
    "keeps_master",
    "master_of",
    "restore_master_state_",
    "resync_master_",
    "store_masters_",
    "widen_buffers_",
]

#: the parameter dtypes whose chain keeps a float32 master copy at T > 0
HALF_DTYPES = (torch.float16, torch.bfloat16)

#: the state entry holding a half-precision parameter's float32 position
MASTER = "master_param"


def is_half(tensor: Tensor) -> bool:
    """Whether ``tensor`` is float16 or bfloat16."""
    return tensor.dtype in HALF_DTYPES


def keeps_master(param: Tensor, state: dict[str, Any], temperature: float) -> bool:
    """Whether this step of ``param`` runs on a master: half, and at T > 0 or with one."""
    return is_half(param) and (temperature > 0 or MASTER in state)


def widen_buffers_(param: Tensor, state: dict[str, Any], skip: Iterable[str]) -> None:
    """Replace every floating buffer of ``param``'s state held in its dtype by a float32 copy.

    ``skip`` names the entries kept as they are (host numbers, the noise key).
    """
    kept = set(skip)
    for name, value in list(state.items()):
        if (
            name not in kept
            and isinstance(value, Tensor)
            and value.dtype == param.dtype
            and value.device == param.device
        ):
            state[name] = value.float()


def _mark_like(master: Tensor, param: Tensor) -> None:
    """Give ``master`` the marks of ``param`` the kernels read (its layout, member dims)."""
    layout = parameter_layout(param)
    if layout is not None and parameter_layout(master) != layout:
        set_parameter_layout(master, *layout)
    dims = member_dims(param)
    if dims and member_dims(master) != dims:
        set_member_dims(master, dims)


def resync_master_(param: Tensor, master: Tensor) -> None:
    r"""Re-seed ``master`` from ``param`` wherever ``param`` is not the master's rounding.

    :math:`m \leftarrow m` where ``param == m.to(param.dtype)``, else ``param`` widened:
    a value assigned to the parameter from outside since the last step wins, element by
    element; elsewhere the master keeps the bits the parameter cannot hold. One
    elementwise pass on the device, nothing read back to Python.
    """
    same = param.eq(master.to(param.dtype))
    torch.where(same, master, param.to(master.dtype), out=master)


class MasterSync:
    """What each parameter looked like when the last step stored its master's rounding.

    Per parameter (by ``id``): its version counter, its data pointer and the master it was
    written from. While all three are unchanged nobody wrote the parameter through itself
    since, and the compare of :func:`resync_master_` is skipped. Runtime only (not saved):
    a loaded optimizer compares once.
    """

    def __init__(self) -> None:
        self._written: dict[int, tuple[int, int, int]] = {}

    @staticmethod
    def _mark(param: Tensor, master: Tensor) -> tuple[int, int, int]:
        return (param._version, param.data_ptr(), id(master))

    def unchanged(self, param: Tensor, master: Tensor) -> bool:
        """Whether ``param`` holds what the last step wrote from ``master``, as far as seen.

        Always True under ``torch.compile``, which cannot compare (module docstring).
        """
        if torch.compiler.is_compiling():
            return True
        return self._written.get(id(param)) == self._mark(param, master)

    def written(self, param: Tensor, master: Tensor) -> None:
        """Record that ``param`` was just written from ``master``."""
        if not torch.compiler.is_compiling():
            self._written[id(param)] = self._mark(param, master)


def master_of(
    param: Tensor, state: dict[str, Any], skip: Iterable[str], sync: MasterSync | None = None
) -> Tensor:
    """``param``'s float32 master: created from its value, or re-seeded where it changed.

    Creating it widens the buffers already in ``param``'s dtype (:func:`widen_buffers_`).
    ``sync`` skips the compare where the parameter cannot have changed.
    """
    master = state.get(MASTER)
    if master is None:
        master = param.detach().to(
            dtype=torch.float32, memory_format=torch.contiguous_format, copy=True
        )
        state[MASTER] = master
    elif sync is None or not sync.unchanged(param, master):
        resync_master_(param, master)
    widen_buffers_(param, state, (*skip, MASTER))
    _mark_like(master, param)
    return master


def compute_tensors(
    params: list[Tensor],
    state: Mapping[Tensor, dict[str, Any]],
    *,
    temperature: float,
    skip: Iterable[str],
    sync: MasterSync | None = None,
) -> list[Tensor | None]:
    """Each parameter's master for this step (:func:`master_of`), or None: itself.

    ``state`` is the optimizer's (a ``defaultdict``): an entry is created only for a
    parameter that keeps a master.
    """
    skipped = tuple(skip)
    masters: list[Tensor | None] = []
    for param in params:
        if is_half(param) and keeps_master(param, state.get(param) or {}, temperature):
            masters.append(master_of(param, state[param], skipped, sync))
        else:
            masters.append(None)
    return masters


def store_masters_(
    params: list[Tensor], masters: list[Tensor | None], sync: MasterSync | None = None
) -> None:
    """Round each updated master to its parameter's dtype, to nearest, into the parameter.

    The parameter keeps its storage (``copy_``); ``sync`` records the write.
    """
    for param, master in zip(params, masters, strict=True):
        if master is not None:
            param.copy_(master)
            if sync is not None:
                sync.written(param, master)


def check_saved_master(param_id: Any, param: Tensor, value: Any) -> None:
    """Raise ``ValueError`` unless a saved ``master_param`` fits ``param`` (before loading)."""
    if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.shape != param.shape:
        shown = (
            f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            if isinstance(value, Tensor)
            else repr(value)
        )
        raise ValueError(
            f"Invalid state_dict: {MASTER!r} of parameter {param_id} is {shown} (expected "
            f"a torch.float32 tensor of its parameter's shape {tuple(param.shape)})"
        )


def restore_master_state_(
    param: Tensor, state: dict[str, Any], saved: Mapping[str, Any], skip: Iterable[str]
) -> None:
    """Undo ``torch.optim.Optimizer.load_state_dict``'s cast to ``param``'s dtype.

    For a half-precision parameter saved with a master, the master and every floating
    buffer take back their saved dtype (float32) on ``param``'s device, so the chain
    resumes bit for bit. A master saved for a parameter that is no longer half precision
    is dropped: the parameter itself holds the position.
    """
    if MASTER not in saved:
        return
    if not is_half(param):
        state.pop(MASTER, None)
        return
    kept = set(skip)
    for name, value in saved.items():
        if name not in kept and isinstance(value, Tensor) and value.is_floating_point():
            state[name] = value.detach().to(device=param.device, copy=True)
