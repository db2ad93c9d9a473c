"""A second device on a CPU-only machine, so that tests catch tensors built on the wrong device.

On a GPU a tensor made without `device=` lands on the CPU, and the first operation that meets a
model's CUDA tensors fails ("Expected all tensors to be on the same device"). Without a GPU every
tensor is on the CPU and such a bug cannot show. Inside `second_device()`, tensors moved to
`DEVICE` (`.to(DEVICE)`, `device=DEVICE` in a factory, `model.to(DEVICE)`) keep their data on the
CPU but report `DEVICE` and follow CUDA's placement rules:
- an operation mixing them with a CPU tensor of one or more dimensions raises, as CUDA does
  (0-dim CPU tensors mix, as CUDA lets them; a CPU index may index a tensor on DEVICE, not the reverse);
- results of operations on them are on DEVICE; `.cpu()` / `.to("cpu")` bring a copy back;
- `.numpy()` of one raises, as for a CUDA tensor.
DEVICE is `meta`, the one non-CPU device type a CPU build of torch can run autograd on; no real
meta tensor (one without data) may appear inside the block.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

DEVICE = torch.device("meta")
# Operations that may take tensors on two devices (copies between them).
_CROSS_DEVICE = ("_to_copy", "copy_", "_copy_from", "lift_fresh", "lift_fresh_copy", "_local_scalar_dense")
_INDEXING = ("index", "index_put", "index_put_", "_index_put_impl_")


class OnDevice(torch.Tensor):
    """A CPU tensor (`.inner`) that reports DEVICE."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=DEVICE, requires_grad=False,
        )

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __repr__(self):
        return f"OnDevice({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a tensor on the test's second device was used outside second_device()")

    def numpy(self, *args, **kwargs):
        raise TypeError(f"can't convert {DEVICE.type} device type tensor to numpy. Use Tensor.cpu() first")


def _is_device(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


class _Factories(TorchFunctionMode):
    """torch.tensor / as_tensor / Tensor.new_tensor build their data before any dispatch: build it on the CPU, then
    move. Tensor.tolist reads the data directly, as it may from a CUDA tensor. A list used as an
    index would become a tensor on DEVICE without data: it becomes a CPU index, which CUDA allows."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.tolist and isinstance(args[0], OnDevice):
            return args[0].inner.tolist()
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], OnDevice):
            as_index = lambda i: torch.tensor(i) if isinstance(i, list) else i  # noqa: E731
            index = args[1]
            index = tuple(map(as_index, index)) if isinstance(index, tuple) else as_index(index)
            args = (args[0], index, *args[2:])
        if func is torch.Tensor.new_tensor and isinstance(args[0], OnDevice):
            func, kwargs = torch.tensor, {"dtype": args[0].dtype, "device": DEVICE, **kwargs}
            args = args[1:]
        if func in (torch.tensor, torch.as_tensor) and _is_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
            return func(*args, **kwargs).to(DEVICE)
        return func(*args, **kwargs)


class _Placement(TorchDispatchMode):
    """Runs every operation on the CPU data, enforcing CUDA's placement rules (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = func.overloadpacket.__name__
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if any(x.device.type == DEVICE.type and not isinstance(x, OnDevice) for x in tensors):
            raise RuntimeError(f"{func}: a {DEVICE.type} tensor without data inside second_device()")
        on_device = [x for x in tensors if isinstance(x, OnDevice)]
        on_cpu = [x for x in tensors if not isinstance(x, OnDevice) and x.dim() > 0]
        if name in _INDEXING:  # CUDA moves CPU indices to the indexed tensor's device, not the reverse
            mixed = not isinstance(args[0], OnDevice) and args[0].dim() > 0 and bool(on_device)
        else:
            mixed = name not in _CROSS_DEVICE and bool(on_device) and bool(on_cpu)
        if mixed:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                               f"devices, {DEVICE.type} and cpu! ({func})")
        to_device = _is_device(kwargs.get("device"))
        if to_device:
            kwargs["device"] = torch.device("cpu")
        unwrap = lambda x: x.inner if isinstance(x, OnDevice) else x  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if name == "_to_copy":
            wrap = to_device or ("device" not in kwargs and bool(on_device))
        elif name in ("copy_", "_copy_from"):
            wrap = isinstance(args[0], OnDevice)
        else:
            wrap = to_device or bool(on_device)
        if name.endswith("_") and args and isinstance(args[0], OnDevice):
            return args[0]  # in place: the same tensor
        return tree_map(lambda x: OnDevice(x) if wrap and isinstance(x, torch.Tensor) else x, out)


@contextlib.contextmanager
def second_device():
    """Inside: DEVICE behaves as a second device with CUDA's rules (module docstring)."""
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # model.to(DEVICE) makes new Parameters
    try:
        with _Factories(), _Placement():
            yield DEVICE
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
