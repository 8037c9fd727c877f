"""What a GEMM launch's parameters take from its arguments, shared by the standalone GEMMs
(megamoe.gemm) and the fused layer (megamoe.moe): GemmParams' one builder (gemm_params), the
kernel weights' fields (weight_fields), their part of a launch's cache key (kw_key) and their checks (the device, the fast
mode's weight domain), and the argument checks both make (require_cuda, the activation clamp).
Every check raises MegaMoEInputError naming the argument (SPEC §7), before any launch.
"""

from __future__ import annotations

import torch

from megamoe.reference.errors import fail
from megamoe.reference import quantize as Q
from megamoe.reference.formats import round_bf16

from .jit import contract, driver
from .jit.layout import KernelWeights


# The GemmParams fields that gemm_params fills from its positional arguments (and `channels`); every
# other field is the caller's.
SHAPE_FIELDS = ("tmap_x8", "tmap_x64", "num_experts", "num_pool_rows", "k", "k32_steps", "n_rows", "err")


def gemm_params(
    x: int, k: int, rows: int, n_rows: int, num_experts: int, err: int, *, channels: int | None = None, **fields
) -> bytes:
    """GemmParams' bytes, built here for every launch that takes them (the standalone GEMMs, their
    predecode pass, the fused layer's two layers): the activations' two tensor maps over `rows` x
    `k` bytes at address `x` (boxes of 8 and CHUNK_N rows; x = 0: none, for the predecode pass,
    which reads no activations), the shape, the channels of the reduction (k32_steps: `k` unless
    `channels`, the size that `k` pads to whole K blocks, says fewer), the trap record `err`, and
    every other field by name (contract.pack_params refuses a missing or unknown one)."""
    if x:
        maps = dict(
            tmap_x8=driver.tma_2d_u8(x, k, rows, k, contract.BLOCK_K, 8),
            tmap_x64=driver.tma_2d_u8(x, k, rows, k, contract.BLOCK_K, contract.CHUNK_N),
        )
    else:
        maps = dict(tmap_x8=bytes(128), tmap_x64=bytes(128))
    return contract.pack_params(
        **maps,
        num_experts=num_experts,
        num_pool_rows=rows,
        k=k,
        k32_steps=(k if channels is None else channels) // 32,
        n_rows=n_rows,
        err=err,
        **fields,
    )


# A layer's KernelWeights tensors (w{layer}{part}), each of whose addresses that layer's launch holds
# (weight_fields) and its key's weights part names (kw_key); both layers' are the device check's.
_KW_PARTS = ("", "_sf", "_lut", "_row_base", "_expert_base", "_fold")
KW_TENSORS = tuple(f"w{layer}{part}" for layer in (1, 2) for part in _KW_PARTS)


def check_weights_device(kw: KernelWeights, dev: torch.device) -> None:
    """The weights on the activations' device: the kernel dereferences them (on another device, or
    on the CPU, the launch would fault and end the context)."""
    for name in KW_TENSORS:
        t = getattr(kw, name)
        if t.device != dev:
            fail("kw", f"weights on {dev} (transform_weights of tensors there)", f"{name} on {t.device}")


def check_fast_spread(name: str, spread: int, promotion: str) -> None:
    """The fast mode's weight domain (SPEC §2, megamoe.reference.quantize.FAST_ROW_SPREAD): `spread`,
    the weights' largest B_e - B_r (KernelWeights.row_spread, reference.quantize.weight_row_spread),
    refused naming `name` in the fast mode when it is larger."""
    if promotion == "k128" and spread > Q.FAST_ROW_SPREAD:
        fail(
            name,
            f"for promotion 'k128', every row's largest scale byte at most {Q.FAST_ROW_SPREAD} under its "
            "expert's largest (else promotion 'k32')",
            f"a row {spread} under",
        )


def require_cuda(name: str, t: torch.Tensor) -> None:
    """The kernels run on a CUDA GPU: a tensor elsewhere is refused naming its argument, saying so
    when torch sees no GPU at all (the one check of the entry points and of the fused layer)."""
    if t.device.type != "cuda":
        why = "" if torch.cuda.is_available() else " (torch sees no CUDA GPU on this machine)"
        fail(name, "a CUDA tensor", f"device {t.device}{why}")


def clamp(activation_clamp) -> tuple[float, int]:
    """SPEC §2: c > 0, rounded to fp32 and then to bf16 (the reference's round_bf16)."""
    if activation_clamp is None:
        return 0.0, 0
    if isinstance(activation_clamp, bool) or not isinstance(activation_clamp, (int, float)):
        fail("activation_clamp", "None or a number > 0", repr(activation_clamp))
    c = float(round_bf16(torch.tensor([float(activation_clamp)], dtype=torch.float32))[0])
    if not c > 0:  # also NaN
        fail("activation_clamp", "a number > 0", repr(activation_clamp))
    return c, 1


def layer_weights(kw: KernelWeights, layer: int) -> tuple[torch.Tensor, ...]:
    """`layer`'s KernelWeights tensors (w{layer}{part} for each of _KW_PARTS)."""
    return tuple(getattr(kw, f"w{layer}{part}") for part in _KW_PARTS)


def kw_key(kw, layer: int) -> tuple:
    """The weights' part of a `layer` launch's key: every address the launch holds (weight_fields)."""
    if not isinstance(kw, KernelWeights):
        return (id(kw),)
    return tuple(t.data_ptr() for t in layer_weights(kw, layer))


def weight_fields(kw: KernelWeights, layer: int, promotion: str) -> dict:
    """The weights' GemmParams fields; the exact mode reads the row and expert bases and the fold
    flags on its prefill path only (the blocks it folds)."""
    w, sf, lut, row_base, expert_base, fold = layer_weights(kw, layer)
    fast = promotion == "k128"
    return dict(
        w=w.data_ptr(),
        w_sf=(lut if fast else sf).data_ptr(),
        w_row_base=row_base.data_ptr(),
        w_expert_base=expert_base.data_ptr(),
        w_fold=0 if fast else fold.data_ptr(),
    )
