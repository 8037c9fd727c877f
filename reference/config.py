"""The shape and mode of one MoE layer call: the notation of SPEC (H, I, E, K, R, T_max)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MoEConfig:
    hidden: int  # H
    intermediate: int  # I (L1 produces 2I: gate and up)
    num_experts: int  # E, global
    top_k: int  # K
    num_ranks: int = 1  # R
    max_tokens_per_rank: int = 256  # T_max
    block_m: int = 64  # pool rows per block; every expert starts on a multiple of it
    activation_clamp: float | None = None  # c; None = no clamp
    fast_math: bool = True  # selects the SiLU table (SPEC §3 D6 step 3)

    def __post_init__(self) -> None:
        from .validate import check_config
        check_config(self)

    @property
    def local_experts(self) -> int:  # E_l
        return self.num_experts // self.num_ranks

    def owner(self, expert: int) -> int:
        return expert // self.local_experts

    def to_dict(self) -> dict:
        return asdict(self)


# The main job's default: small enough for the CPU reference to run in seconds.
DEFAULT_CONFIG = MoEConfig(hidden=1024, intermediate=512, num_experts=16, top_k=4, num_ranks=2,
                           max_tokens_per_rank=128, block_m=64)
