"""Bad input (SPEC §7): every check raises MegaMoEInputError naming the argument, the expected and
the actual value, before anything runs."""

from __future__ import annotations

import torch

from .config import MoEConfig
from .errors import fail
from .inputs import RankInputs
from .weights import ExpertWeights

TMA_ALIGNMENT = 16  # bytes: the kernel's bulk tensor copies need 16-byte aligned rows and bases


def _check_tensor(name: str, t, dtype, shape: tuple, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype != dtype:
        fail(name, f"dtype {dtype}", t.dtype)
    if tuple(t.shape) != tuple(shape):
        fail(name, f"shape {list(shape)}", list(t.shape))
    if device is not None and t.device != device:
        fail(name, f"device {device}", t.device)
    if not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()}")


def _check_alignment(name: str, t: torch.Tensor) -> None:
    if t.device.type != "meta" and t.numel() and t.data_ptr() % TMA_ALIGNMENT:
        fail(
            name,
            f"a {TMA_ALIGNMENT}-byte aligned base address",
            f"address {t.data_ptr():#x} (offset {t.data_ptr() % TMA_ALIGNMENT} bytes; a sliced view? pass .clone())",
        )


def _check_scales(name: str, sf: torch.Tensor) -> None:
    bad = (sf == 255).nonzero()
    if bad.numel():
        fail(name, "UE8M0 scale bytes in [0, 254] (255 is NaN)", f"255 at {bad[0].tolist()}")


def check_rank_inputs(cfg: MoEConfig, inp: RankInputs, rank: int = 0) -> None:
    """The inputs of one rank (SPEC §2, §7)."""
    t = inp.x.shape[0] if isinstance(inp.x, torch.Tensor) and inp.x.dim() == 2 else None
    if t is None:
        fail("x", "a 2-D tensor [T, H]", getattr(inp.x, "shape", type(inp.x).__name__))
    if t > cfg.max_tokens_per_rank:
        fail("x", f"at most T_max = {cfg.max_tokens_per_rank} tokens (rank {rank})", t)
    device = inp.x.device
    _check_tensor("x", inp.x, torch.float8_e4m3fn, (t, cfg.hidden), device)
    _check_tensor("x_sf", inp.x_sf, torch.uint8, (t, cfg.hidden // 32), device)
    _check_tensor("topk_idx", inp.topk_idx, torch.int64, (t, cfg.top_k), device)
    _check_tensor("topk_weights", inp.topk_weights, torch.float32, (t, cfg.top_k), device)
    _check_alignment("x", inp.x)
    _check_alignment("x_sf", inp.x_sf)
    _check_scales("x_sf", inp.x_sf)
    idx = inp.topk_idx
    out_of_range = ((idx < -1) | (idx >= cfg.num_experts)).nonzero()
    if out_of_range.numel():
        pos = out_of_range[0].tolist()
        fail("topk_idx", f"expert ids in [-1, {cfg.num_experts})", f"{int(idx[tuple(pos)])} at {pos}")
    if t and cfg.top_k > 1:
        s = torch.sort(idx, dim=1).values
        dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).nonzero()
        if dup.numel():
            row = int(dup[0, 0])
            fail(
                "topk_idx",
                "distinct experts within a token",
                f"expert {int(s[row, dup[0, 1] + 1])} twice in token {row} (rank {rank})",
            )


def check_weights(cfg: MoEConfig, w: ExpertWeights, num_experts: int | None = None) -> None:
    """Canonical weights of `num_experts` experts (default: all E)."""
    e = cfg.num_experts if num_experts is None else num_experts
    h, i = cfg.hidden, cfg.intermediate
    device = w.w1.device
    _check_tensor("w1", w.w1, torch.uint8, (e, 2 * i, h // 2), device)
    _check_tensor("w1_sf", w.w1_sf, torch.uint8, (e, 2 * i, h // 32), device)
    _check_tensor("w2", w.w2, torch.uint8, (e, h, i // 2), device)
    _check_tensor("w2_sf", w.w2_sf, torch.uint8, (e, h, i // 32), device)
    _check_scales("w1_sf", w.w1_sf)
    _check_scales("w2_sf", w.w2_sf)


def check_call(cfg: MoEConfig, inputs: list[RankInputs], weights: ExpertWeights) -> None:
    if len(inputs) != cfg.num_ranks:
        fail("inputs", f"one RankInputs per rank ({cfg.num_ranks})", len(inputs))
    for rank, inp in enumerate(inputs):
        check_rank_inputs(cfg, inp, rank)
    check_weights(cfg, weights)
