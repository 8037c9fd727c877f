"""Bad input (SPEC §7): every check raises MegaMoEInputError naming the argument, the expected and
the actual value, before anything runs. Here the contract's own tensors (a call's inputs, its
weights, expert ids); the generic argument checks are errors.py's."""

from __future__ import annotations

import torch

from .config import MoEConfig
from .errors import check_int, check_list, check_tensor, check_type, fail
from .inputs import RankInputs
from .weights import ExpertWeights

TMA_ALIGNMENT = 16  # bytes: the kernel's bulk tensor copies need 16-byte aligned rows and bases


def _check_tensor(name: str, t, dtype, shape: tuple, device=None) -> None:
    """A kernel operand: check_tensor, contiguous (megamoe.moe checks the layer's `out` with it too)."""
    check_tensor(name, t, dtype, shape, device, contiguous=True)


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


def check_expert_ids(name: str, idx: torch.Tensor, num_experts: int) -> None:
    """Every expert id of `idx` in [-1, num_experts) (-1: no expert, SPEC §2)."""
    out_of_range = ((idx < -1) | (idx >= num_experts)).nonzero()
    if out_of_range.numel():
        pos = out_of_range[0].tolist()
        fail(name, f"expert ids in [-1, {num_experts})", f"{int(idx[tuple(pos)])} at {pos}")


def check_rank_inputs(cfg: MoEConfig, inp: RankInputs, rank: int = 0, device: torch.device | None = None) -> None:
    """The inputs of one rank (SPEC §2, §7), on `device` (default: x's, which must hold data)."""
    check_type("cfg", cfg, MoEConfig)
    check_type("inp", inp, RankInputs)
    t = inp.x.shape[0] if isinstance(inp.x, torch.Tensor) and inp.x.dim() == 2 else None
    if t is None:
        fail("x", "a 2-D tensor [T, H]", getattr(inp.x, "shape", type(inp.x).__name__))
    if t > cfg.max_tokens_per_rank:
        fail("x", f"at most T_max = {cfg.max_tokens_per_rank} tokens (rank {rank})", t)
    if device is None:
        # x names the call's device; a meta x has no values to check or compute on, so it is
        # refused itself rather than the others blamed for being on a device with data.
        device = inp.x.device
        if device.type == "meta":
            fail("x", "a tensor with data (on the CPU or a GPU)", "device meta")
    _check_tensor("x", inp.x, torch.float8_e4m3fn, (t, cfg.hidden), device)
    _check_tensor("x_sf", inp.x_sf, torch.uint8, (t, cfg.hidden // 32), device)
    _check_tensor("topk_idx", inp.topk_idx, torch.int64, (t, cfg.top_k), device)
    _check_tensor("topk_weights", inp.topk_weights, torch.float32, (t, cfg.top_k), device)
    _check_alignment("x", inp.x)
    _check_alignment("x_sf", inp.x_sf)
    _check_scales("x_sf", inp.x_sf)
    idx = inp.topk_idx
    check_expert_ids("topk_idx", idx, cfg.num_experts)
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


def check_weights(
    cfg: MoEConfig, w: ExpertWeights, num_experts: int | None = None, device: torch.device | None = None
) -> None:
    """Canonical weights of `num_experts` experts (default: all E), on `device` (default: w1's)."""
    check_type("cfg", cfg, MoEConfig)
    check_type("weights", w, ExpertWeights)
    if num_experts is not None:
        check_int("num_experts", num_experts, 1)
    e = cfg.num_experts if num_experts is None else num_experts
    h, i = cfg.hidden, cfg.intermediate
    if device is None and isinstance(w.w1, torch.Tensor):
        device = w.w1.device
    _check_tensor("w1", w.w1, torch.uint8, (e, 2 * i, h // 2), device)
    _check_tensor("w1_sf", w.w1_sf, torch.uint8, (e, 2 * i, h // 32), device)
    _check_tensor("w2", w.w2, torch.uint8, (e, h, i // 2), device)
    _check_tensor("w2_sf", w.w2_sf, torch.uint8, (e, h, i // 32), device)
    _check_scales("w1_sf", w.w1_sf)
    _check_scales("w2_sf", w.w2_sf)
    # SPEC §8's biases: only a "swiglu_oai" layer reads them (a project choice, docs/SPEC.md §8)
    for name, bias, n in (("b1", w.b1, 2 * i), ("b2", w.b2, h)):
        if bias is None:
            continue
        if cfg.activation != "swiglu_oai":
            fail(name, f"None with activation {cfg.activation!r} (biases are the gpt-oss variant's)", "a tensor")
        _check_tensor(name, bias, torch.bfloat16, (e, n), device)


def check_all_inputs(cfg: MoEConfig, inputs: list[RankInputs], arg: str = "inputs") -> torch.device:
    """One RankInputs per rank (`arg`: the caller's name for the list), all on one device; returns it."""
    check_type("cfg", cfg, MoEConfig)
    check_list(arg, inputs, cfg.num_ranks, f"{cfg.num_ranks} RankInputs, one per rank")
    device = None
    for rank, inp in enumerate(inputs):
        check_type(f"{arg}[{rank}]", inp, RankInputs)
        check_rank_inputs(cfg, inp, rank, device)
        device = inp.x.device  # every later rank's tensors on rank 0's device
    return device


def check_call(cfg: MoEConfig, inputs: list[RankInputs], weights: ExpertWeights) -> None:
    """A whole call (run_reference, run_oracle): every rank's inputs and the global weights, on one device."""
    device = check_all_inputs(cfg, inputs)
    check_weights(cfg, weights, device=device)
