"""The GEMM core's runtime, per process and device: what the standalone GEMMs (megamoe.gemm) and the
fused layer (megamoe.moe) launch through (their launchers, megamoe.launchers) and share.

* the trap record of each device (err_record: pinned host memory every launch's GemmParams.err
  points at) and its reading in words (timeout_message);
* the dynamic item order's counters (item_counter);
* the loaded kernels (kernel(spec, dev): a Kernel per specialisation and device);
* the current stream (raw_stream, stream_of, stream);
* the launch caches (cached_call: an entry point's call by its key; cached_launch / keep_launch:
  built launches by theirs), emptied when full;
* the prefill path's scratch buffers of predecoded weights (prefill_scratch,
  release_prefill_buffers);
* PreparedCall, a launch made ready for its tensors (megamoe.gemm.PreparedGemm,
  megamoe.moe.PreparedLayer).
"""

from __future__ import annotations

import dataclasses

import torch

from megamoe.reference import MegaMoEInputError

from .jit import build as jb
from .jit import contract, driver


# ---------------------------------------------------------------------------------------------
# Trap record (SPEC §5)
# ---------------------------------------------------------------------------------------------
# One record per device for the process, allocated before the first launch on that device and
# never replaced: every cached launch (_LAUNCHES, _CALLS) holds its address in its packed
# parameters, so a new buffer would be one the cached launches never write. Cleared in place.
_ERR: dict[int, torch.Tensor] = {}


def device_index(dev: int | str | torch.device | None) -> int:
    """A device as its index: an int, "cuda:N" or a torch.device; without an index (None, "cuda"),
    the current device. One key per device, whichever way the launcher and the reader name it."""
    if dev is None:
        return torch.cuda.current_device()
    if isinstance(dev, (str, torch.device)):
        d = torch.device(dev)
        return d.index if d.index is not None else torch.cuda.current_device()
    return int(dev)


def err_record(dev: int | str | torch.device | None) -> torch.Tensor:
    """Pinned memory of device `dev` for the kernel's trap record (contract.TRAP_RECORD, as int32
    words), readable after a trap (the trap ends the context; host memory outlives it). torch's pinned memory is page-locked host memory
    that every device reaches at the same address (unified addressing, which sm_90 always has), so
    its data_ptr() is the device pointer GemmParams::err takes."""
    dev = device_index(dev)
    if dev not in _ERR:
        rec = torch.zeros(contract.TRAP_RECORD.size // 4, dtype=torch.int32, pin_memory=True)
        if not rec.is_pinned():
            raise RuntimeError("the trap record needs pinned host memory; torch gave pageable memory")
        _ERR[dev] = rec
    return _ERR[dev]


# The dynamic item order's counters (GemmParams.item_counter, scheduler.cuh claim_item): an int32
# pair per launch object, never reused (a CUDA graph keeps the address of the pair it was captured
# with for as long as it lives), from zeroed chunks of _ITEM_COUNTER_CHUNK pairs per device. Each
# launch leaves its pair zero. Launch objects of these kernels are cached per stream
# (megamoe.launchers.GemmLauncher), so two streams never run one pair at once: two grids on one pair
# could leave it non-zero, and every later launch on it would skip items. (A CUDA graph captured on a stream keeps that stream's pairs:
# it must not be replayed while calls on that stream, eager, prepared or another replay, run.)
_ITEM_COUNTERS: dict[int, list[torch.Tensor]] = {}
_ITEM_COUNTER_CHUNK = 4096
_ITEM_COUNTERS_USED: dict[int, int] = {}


def item_counter(dev: int) -> int:
    """The device address of a fresh, zeroed pair of item counters on device `dev`."""
    chunks = _ITEM_COUNTERS.setdefault(dev, [])
    used = _ITEM_COUNTERS_USED.get(dev, 0)
    if used == len(chunks) * _ITEM_COUNTER_CHUNK:
        if torch.cuda.is_current_stream_capturing():
            # Memory zeroed during a capture is zeroed only when the graph replays.
            raise RuntimeError(
                "megamoe needs new item counters for this launch and cannot zero them during a CUDA graph"
                " capture: make one call with these arguments before the capture"
            )
        chunk = torch.zeros(2 * _ITEM_COUNTER_CHUNK, dtype=torch.int32, device=f"cuda:{dev}")
        # Zeroed on this stream; a launch on another stream must not see the memory before.
        torch.cuda.current_stream(dev).synchronize()
        chunks.append(chunk)
    _ITEM_COUNTERS_USED[dev] = used + 1
    return chunks[used // _ITEM_COUNTER_CHUNK].data_ptr() + 8 * (used % _ITEM_COUNTER_CHUNK)


def _record_devices(dev) -> list[int]:
    """The devices a record query names: one (see device_index), or every device with a record (None)."""
    return sorted(_ERR) if dev is None else [device_index(dev)]


def timeout_message(dev: int | str | torch.device | None = None) -> str | None:
    """Words for the kernel's trap record (a wait that timed out, or the shared-memory layout
    check), or None when no launch trapped through it: device `dev`'s record, or (None, the
    default) the first device's that holds one. Read it once a CUDA call has reported the failure
    (the trapping thread writes and fences the record before its trap). Word 0 is 1 when the record is
    complete, 2 when the trapping thread claimed it but the trap ended the kernel before it set 1
    (its fields were written and fenced first, so they are still shown)."""
    for d in _record_devices(dev):
        r = _ERR.get(d)
        words = r.tolist() if r is not None else [0]  # one read of all words
        if words[0] != 0:
            return _record_words(words)
    return None


def _record_words(words: list[int]) -> str:
    field = {name: words[off // 4] for name, off in contract.TRAP_RECORD.offsets.items()}
    state, what, blk, idx = field["state"], field["what"], field["block"], field["index"]
    exp, obs, thr = field["expected"], field["observed"], field["thread"]
    note = "" if state == 1 else " (record claimed, completion flag not seen)"
    if what == contract.LAYOUT_CHECK:
        return (
            f"SM block {blk} thread {thr}: the launch gave {obs} bytes of dynamic shared memory at offset "
            f"{idx} mod 1024, the kernel's layout needs {exp} bytes, 1024-aligned{note}"
        )
    return (
        f"SM block {blk} thread {thr}: waited for {contract.WAITS.get(what, what)} {idx}: "
        f"expected {exp}, observed {obs}{note}"
    )


# ---------------------------------------------------------------------------------------------
# Compiled kernels and cached launches
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kernel:
    """A loaded specialisation and how it is launched, as the cubin itself says (its shared memory
    layout size, threads and stages are __constant__s of the module)."""

    spec: jb.GemmSpec | jb.FusedSpec | jb.PrefillSpec | jb.PredecodeSpec
    module: object  # the loaded cubin (driver.module_global reads its globals)
    fn: object
    smem_bytes: int
    threads: int
    stages: int
    num_sms: int


_KERNELS: dict[tuple[jb.GemmSpec | jb.FusedSpec | jb.PrefillSpec | jb.PredecodeSpec, int], Kernel] = {}
_LAUNCHES: dict[tuple, driver.Launch] = {}
_MAX_CACHED_LAUNCHES = 512


def kernel(spec: jb.GemmSpec | jb.FusedSpec | jb.PrefillSpec | jb.PredecodeSpec, dev: int) -> Kernel:
    key = (spec, dev)
    if key not in _KERNELS:
        mod = driver.load_module(jb.build(spec).cubin, dev)
        smem = driver.module_constant(mod, "megamoe_smem_bytes")
        threads = driver.module_constant(mod, "megamoe_threads")
        if threads != spec.threads:
            raise RuntimeError(f"{spec.name}: the cubin has {threads} threads, the spec {spec.threads}")
        _KERNELS[key] = Kernel(
            spec,
            mod,
            driver.get_function(mod, spec.kernel, smem),
            smem,
            threads,
            driver.module_constant(mod, "megamoe_stages"),
            driver.num_sms(dev),
        )
    return _KERNELS[key]


# Repeated calls with the same tensors and arguments skip straight to the cached launch: the key
# holds every tensor's address, dtype, shape and strides, so what passed the checks once passes again.
_CALLS: dict[tuple, driver.Launch] = {}


raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(dev: int) -> int:
    """The current CUDA stream of device `dev` (torch's raw getter where it has one: ~10x cheaper)."""
    if raw_stream is not None:
        return raw_stream(dev)
    return torch.cuda.current_stream(dev).cuda_stream


def stream(x: torch.Tensor) -> int:
    """The current CUDA stream of x's device."""
    return stream_of(x.device.index)


def cached_call(key, stream, plan, args: dict, cached_result):
    """An entry point's call: the launch cached under `key` (None: a call that is not cached) on
    `stream`, returning cached_result(); else plan(**args) checked, built, launched and cached."""
    if key is not None:
        launch = _CALLS.get(key)
        if launch is not None:
            launch(stream)
            return cached_result()
    call = plan(**args)
    call()
    if key is not None:
        if len(_CALLS) >= _MAX_CACHED_LAUNCHES:
            _CALLS.clear()
        _CALLS[key] = call.run
    return call.result


def cached_launch(key) -> driver.Launch | None:
    """The launch keep_launch cached under `key`, or None."""
    return _LAUNCHES.get(key)


def keep_launch(key, launch: driver.Launch) -> driver.Launch:
    """Caches a built launch under `key` (the cache is emptied when full)."""
    if len(_LAUNCHES) >= _MAX_CACHED_LAUNCHES:
        _LAUNCHES.clear()
    _LAUNCHES[key] = launch
    return launch


class PreparedCall:
    """A launch made ready for its tensors: calling it compares the current stream with the one it
    was prepared on (another one is an input error: its launch holds that stream's item counters and
    scratch buffer), launches, and returns `result`, the same object each time. The GEMMs'
    (megamoe.gemm.PreparedGemm) and the fused layer's (megamoe.moe.PreparedLayer)."""

    what = "a prepared call"

    def __init__(self, run, result, device: int, stream: int, tensors: tuple):
        self.run, self.result = run, result
        self.device, self.stream = device, stream
        self._tensors = tensors

    def __call__(self):
        current = stream_of(self.device)
        if current != self.stream:
            # Its launch holds item counters and a scratch buffer of that stream (item_counter, _SCRATCH).
            raise MegaMoEInputError(
                f"{self.what} runs on the stream it was prepared on (0x{self.stream:x}); the current"
                f" stream of cuda:{self.device} is 0x{current:x}: prepare one call per stream"
            )
        self.run(self.stream)
        return self.result


# The predecoded weights of a layer: one scratch buffer per (device, stream, layer, size), reused by
# every call (launches on one stream run in order; eager calls on two streams get two buffers). A
# buffer is E * K * R bytes, 9/8 of that in the exact mode (the DSV3 slice of 32 experts: 940 MB for
# L1, 470 MB for L2; a process that runs both promotions keeps both) and lives until
# release_prefill_buffers(), because the cached launches point into it (and past it while a prepared
# call, PreparedGemm, that holds it lives). CUDA graphs: a graph
# keeps the buffer of the stream it was captured on, so graphs captured on one stream share it and
# must not be replayed at the same time on two streams.
_SCRATCH: dict[tuple, torch.Tensor] = {}


def prefill_scratch(dev: int, stream: int, layer: int, size: int) -> torch.Tensor:
    """The scratch buffer of `size` bytes for a layer's predecoded weights on device `dev` and stream
    `stream` (the standalone prefill path's and the fused layer's prefill engine's), made on first use,
    zeroed (the predecode pass writes every tile before the kernel reads it)."""
    skey = (dev, stream, layer, size)
    scratch = _SCRATCH.get(skey)
    if scratch is None:
        scratch = _SCRATCH[skey] = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{dev}")
    return scratch


def release_prefill_buffers() -> None:
    """Frees the prefill path's scratch buffers (and forgets the cached launches that point into
    them); the next prefill-path call allocates again. A prepared call (PreparedGemm) keeps its
    buffer until it is itself dropped. Not while a captured graph that uses them may still be
    replayed."""
    _SCRATCH.clear()
    _CALLS.clear()
    _LAUNCHES.clear()
