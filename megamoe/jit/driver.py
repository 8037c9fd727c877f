"""The CUDA driver API through ctypes: load cubins, launch kernels, encode TMA descriptors.

torch owns the CUDA context (the device's primary context) and the stream; this module only
borrows them. Every driver call is checked and a failure raises DriverError with the driver's
error name.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from pathlib import Path

_lock = threading.Lock()
_lib = None
_modules: dict[tuple[str, int], ctypes.c_void_p] = {}

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16

# CUtensorMapDataType / swizzle / L2 promotion / OOB fill values (cuda.h).
TMA_UINT8 = 0
TMA_SWIZZLE_128B = 3
TMA_L2_PROMOTION_256B = 3
TMA_OOB_FILL_NONE = 0


class DriverError(RuntimeError):
    pass


def lib():
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                cu = ctypes.CDLL("libcuda.so.1")
                cu.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                cu.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
                cu.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
                cu.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
                cu.cuTensorMapEncodeTiled.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_int,
                    ctypes.c_uint32,
                    ctypes.c_void_p,
                    ctypes.POINTER(ctypes.c_uint64),
                    ctypes.POINTER(ctypes.c_uint64),
                    ctypes.POINTER(ctypes.c_uint32),
                    ctypes.POINTER(ctypes.c_uint32),
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_int,
                ]
                cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
                cu.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
                cu.cuModuleGetGlobal_v2.argtypes = [
                    ctypes.POINTER(ctypes.c_uint64),
                    ctypes.POINTER(ctypes.c_size_t),
                    ctypes.c_void_p,
                    ctypes.c_char_p,
                ]
                cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
                _lib = cu
                check(cu.cuInit(0), "cuInit")
    return _lib


def check(res: int, what: str) -> None:
    if res != 0:
        name = ctypes.c_char_p()
        try:
            _lib.cuGetErrorName(res, ctypes.byref(name))
        except Exception:  # noqa: BLE001
            pass
        raise DriverError(f"{what} failed: CUresult {res} ({(name.value or b'?').decode()})")


def _ensure_context(device: int) -> None:
    import torch

    torch.cuda.set_device(device)
    torch.cuda.current_stream(device)  # makes torch create / bind the primary context
    torch.empty(1, device=f"cuda:{device}")
    ctx = ctypes.c_void_p()
    check(lib().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        raise DriverError("no current CUDA context after torch initialised the device")


def load_module(cubin: Path, device: int) -> ctypes.c_void_p:
    """The module of `cubin`, loaded once per device."""
    key = (str(cubin), device)
    with _lock:
        if key in _modules:
            return _modules[key]
    _ensure_context(device)
    data = Path(cubin).read_bytes()
    buf = ctypes.create_string_buffer(data, len(data))
    mod = ctypes.c_void_p()
    check(lib().cuModuleLoadData(ctypes.byref(mod), ctypes.cast(buf, ctypes.c_void_p)), f"cuModuleLoadData({cubin})")
    with _lock:
        _modules[key] = mod
    return mod


def module_global(mod: ctypes.c_void_p, name: str) -> bytes:
    """The bytes of a loaded module's global `name` (`__constant__` or `__device__`), copied to the host
    (synchronously: after the work on the device that wrote it, which the caller waits for)."""
    dptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    check(
        lib().cuModuleGetGlobal_v2(ctypes.byref(dptr), ctypes.byref(size), mod, name.encode()),
        f"cuModuleGetGlobal({name})",
    )
    buf = ctypes.create_string_buffer(size.value)
    check(lib().cuMemcpyDtoH_v2(buf, dptr.value, size.value), f"cuMemcpyDtoH({name})")
    return buf.raw


def module_constant(mod: ctypes.c_void_p, name: str) -> int:
    """An int32 `__constant__` of a loaded module (what the kernel says about itself: its shared
    memory size, threads, stages)."""
    return int.from_bytes(module_global(mod, name)[:4], "little", signed=True)


def get_function(mod: ctypes.c_void_p, name: str, dyn_smem: int) -> ctypes.c_void_p:
    """The kernel `name` of a loaded module, with its dynamic shared memory limit raised."""
    fn = ctypes.c_void_p()
    check(lib().cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), f"cuModuleGetFunction({name})")
    check(
        lib().cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dyn_smem),
        f"cuFuncSetAttribute(max dynamic smem {dyn_smem})",
    )
    return fn


def num_sms(device: int) -> int:
    v = ctypes.c_int()
    check(
        lib().cuDeviceGetAttribute(ctypes.byref(v), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device),
        "cuDeviceGetAttribute",
    )
    return v.value


# The launch calls through the driver's entry points with no ctypes argtypes: ctypes then converts
# nothing but what it is given (ints as C int, ctypes pointers as pointers), which takes a third of
# the typed call's host time (0.6 against 1.5 us per call, a no-op C function of the same signature),
# a share that counts against a launch's ~5 us. Launch passes the pointers (function, stream, the
# argument array) as ctypes pointers and the grid, block and shared memory sizes (< 2^31) as ints,
# which the System V and AArch64 ABIs pass as the unsigned ints the driver reads.
_RAW_RESULT = ctypes.CFUNCTYPE(ctypes.c_int)


@functools.cache
def _raw(name: str):
    return _RAW_RESULT(ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value)


class Launch:
    """A kernel with its grid, block, shared memory and the bytes of its one by-value struct
    parameter, ready to be launched on any stream (again and again: the argument buffer is kept).
    A cooperative launch guarantees that every CTA is resident at once (or fails), which kernels
    whose CTAs wait on each other need."""

    def __init__(self, fn, grid: int, block: int, dyn_smem: int, params: bytes, *, cooperative: bool = False):
        # The untyped call passes these as C ints, which would truncate larger values silently: they
        # are checked here and read-only after (properties).
        if not (0 < grid < 2**31 and 0 < block <= 1024 and 0 <= dyn_smem < 2**31):
            raise ValueError(f"launch geometry out of range: grid {grid}, block {block}, smem {dyn_smem}")
        self._grid, self._block, self._dyn_smem = int(grid), int(block), int(dyn_smem)
        self._fn = ctypes.c_void_p(fn.value if isinstance(fn, ctypes.c_void_p) else fn)
        self._pbuf = ctypes.create_string_buffer(params, len(params))
        self._args = (ctypes.c_void_p * 1)(ctypes.cast(self._pbuf, ctypes.c_void_p))
        self._cooperative = bool(cooperative)
        self._launch = _raw("cuLaunchCooperativeKernel" if cooperative else "cuLaunchKernel")

    fn = property(lambda self: self._fn, doc="the kernel (CUfunction)")
    grid = property(lambda self: self._grid, doc="CTAs (a 1-D grid)")
    block = property(lambda self: self._block, doc="threads per CTA")
    dyn_smem = property(lambda self: self._dyn_smem, doc="dynamic shared memory bytes per CTA")
    cooperative = property(lambda self: self._cooperative, doc="launched with cuLaunchCooperativeKernel")

    def copy(self, *, cooperative: bool | None = None) -> Launch:
        """The same kernel, geometry and parameter bytes as they are now, in a launch of its own
        (later patches of either one leave the other as it is); `cooperative` as this one's unless given."""
        coop = self._cooperative if cooperative is None else cooperative
        return Launch(self._fn, self._grid, self._block, self._dyn_smem, bytes(self._pbuf), cooperative=coop)

    def patch(self, offset: int, fmt: str, *values) -> None:
        """Rewrites fields of the parameter bytes (struct format `fmt`) for the next launches."""
        struct.pack_into(fmt, self._pbuf, offset, *values)

    def __call__(self, stream: int) -> None:
        s = ctypes.c_void_p(stream)
        if self._cooperative:
            res = self._launch(self._fn, self._grid, 1, 1, self._block, 1, 1, self._dyn_smem, s, self._args)
        else:
            res = self._launch(self._fn, self._grid, 1, 1, self._block, 1, 1, self._dyn_smem, s, self._args, None)
        if res:
            check(res, "cuLaunchCooperativeKernel" if self._cooperative else "cuLaunchKernel")


def tma_2d_u8(ptr: int, inner: int, outer: int, row_stride: int, box_inner: int, box_outer: int) -> bytes:
    """A 128-byte CUtensorMap for a row-major uint8 matrix [outer, inner] (128-byte swizzle)."""
    raw = ctypes.create_string_buffer(128 + 64)  # CUtensorMap is 64-byte aligned
    addr = (ctypes.addressof(raw) + 63) & ~63
    tmap = (ctypes.c_uint64 * 16).from_address(addr)
    dims = (ctypes.c_uint64 * 2)(inner, outer)
    strides = (ctypes.c_uint64 * 1)(row_stride)
    box = (ctypes.c_uint32 * 2)(box_inner, box_outer)
    estr = (ctypes.c_uint32 * 2)(1, 1)
    check(
        lib().cuTensorMapEncodeTiled(
            ctypes.byref(tmap),
            TMA_UINT8,
            2,
            ctypes.c_void_p(ptr),
            dims,
            strides,
            box,
            estr,
            0,
            TMA_SWIZZLE_128B,
            TMA_L2_PROMOTION_256B,
            TMA_OOB_FILL_NONE,
        ),
        f"cuTensorMapEncodeTiled(dims {inner}x{outer}, box {box_inner}x{box_outer})",
    )
    return ctypes.string_at(addr, 128)
