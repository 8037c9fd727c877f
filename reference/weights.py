"""Expert weights: the canonical layout of SPEC §2 and the gate/up interleave of SPEC §2.

Canonical (per rank, E_l local experts):
    w1 [E_l, 2I, H/2] packed FP4, w1_sf [E_l, 2I, H/32] UE8M0; rows [0, I) gate, [I, 2I) up
    w2 [E_l, H, I/2]  packed FP4, w2_sf [E_l, H, I/32]  UE8M0

`interleave_gate_up` puts gate and up rows in blocks of 8, [g0..7, u0..7, g8..15, u8..15, ...]:
rows g and g + 8 of a 16-row wgmma accumulator fragment land in one thread, so that thread holds
the gate and the up value of the same intermediate channel for the SwiGLU. `deinterleave_gate_up`
is its exact inverse. The kernel's full layout is `megamoe.jit.layout.transform_weights`: this
step (one definition, imported from here), then the kernel's fragment order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import check_int, check_tensor, fail
from .quantize import GROUP, quantize_weights

INTERLEAVE = 8


@dataclass
class ExpertWeights:
    w1: torch.Tensor
    w1_sf: torch.Tensor
    w2: torch.Tensor
    w2_sf: torch.Tensor
    # SPEC §8's optional biases (bf16, canonical order: b1 rows [0, I) gate, [I, 2I) up), read by
    # D6 and D8 of a "swiglu_oai" layer; the checkpoint loader (megamoe.checkpoints) gives them.
    b1: torch.Tensor | None = None  # [E, 2I]
    b2: torch.Tensor | None = None  # [E, H]

    def _tensors(self):
        return (self.w1, self.w1_sf, self.w2, self.w2_sf, self.b1, self.b2)

    def to(self, device) -> "ExpertWeights":
        return ExpertWeights(*(None if t is None else t.to(device) for t in self._tensors()))

    def slice(self, start: int, stop: int) -> "ExpertWeights":
        """Experts [start, stop): the local weights of one rank from a global set."""
        return ExpertWeights(*(None if t is None else t[start:stop] for t in self._tensors()))


def _check_gate_up_rows(rows) -> None:
    check_tensor("rows", rows, shape=(None, None, None))
    if rows.shape[1] % (2 * INTERLEAVE):
        fail("rows", f"[E, 2I, X] with 2I a multiple of {2 * INTERLEAVE}", list(rows.shape))


def interleave_gate_up(rows: torch.Tensor) -> torch.Tensor:
    """[E, 2I, X] with gate rows [0, I) and up rows [I, 2I) -> rows interleaved in blocks of 8."""
    _check_gate_up_rows(rows)
    e, two_i, x = rows.shape
    i = two_i // 2
    gate = rows[:, :i].reshape(e, i // INTERLEAVE, 1, INTERLEAVE, x)
    up = rows[:, i:].reshape(e, i // INTERLEAVE, 1, INTERLEAVE, x)
    return torch.cat([gate, up], dim=2).reshape(e, two_i, x)


def deinterleave_gate_up(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of interleave_gate_up."""
    _check_gate_up_rows(rows)
    e, two_i, x = rows.shape
    i = two_i // 2
    blocks = rows.reshape(e, i // INTERLEAVE, 2, INTERLEAVE, x)
    return torch.cat([blocks[:, :, 0].reshape(e, i, x), blocks[:, :, 1].reshape(e, i, x)], dim=1)


def random_weights(num_experts: int, hidden: int, intermediate: int, *, seed: int = 0, device="cpu") -> ExpertWeights:
    """Quantized random weights (global, all experts): every element drawn from N(0, 1/fan_in)
    (std 1/sqrt(fan_in), fan_in = H for w1 and I for w2), then quantized per 32 (SPEC §1)."""
    check_int("num_experts", num_experts, 1)
    for name, size in (("hidden", hidden), ("intermediate", intermediate)):
        check_int(name, size, 1)
        if size % GROUP:  # the per-32 scale groups along K
            fail(name, f"a positive multiple of {GROUP}", size)
    check_int("seed", seed, minimum=None)
    # One expert at a time: the draws are the CPU generator's (the same numbers as one draw of the
    # whole tensor), each expert quantized where the weights are asked for. On the CPU the whole
    # DSV3 slice at once took tens of GB and minutes; the quantizer is device-agnostic.
    g = torch.Generator().manual_seed(seed)

    def layer(rows: int, fan_in: int):
        parts = [
            quantize_weights((torch.randn(rows, fan_in, generator=g) / fan_in**0.5).to(device))
            for _ in range(num_experts)
        ]
        return torch.stack([q.codes for q in parts]), torch.stack([q.scales for q in parts])

    w1, w1_sf = layer(2 * intermediate, hidden)
    w2, w2_sf = layer(hidden, intermediate)
    return ExpertWeights(w1, w1_sf, w2, w2_sf)


def random_biases(
    num_experts: int, hidden: int, intermediate: int, *, seed: int = 0, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random biases of SPEC §8 (global, all experts), bf16 of N(0, 1) draws: b1 [E, 2I] (gate rows,
    then up rows) and b2 [E, H], as ExpertWeights(..., b1=, b2=) takes them."""
    check_int("num_experts", num_experts, 1)
    for name, size in (("hidden", hidden), ("intermediate", intermediate)):
        check_int(name, size, 1)
    check_int("seed", seed, minimum=None)
    g = torch.Generator().manual_seed(seed)
    b1 = torch.randn(num_experts, 2 * intermediate, generator=g).to(torch.bfloat16)
    b2 = torch.randn(num_experts, hidden, generator=g).to(torch.bfloat16)
    return b1.to(device), b2.to(device)
