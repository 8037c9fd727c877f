"""The shape and mode of one MoE layer call: the notation of SPEC (H, I, E, K, R, T_max)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import check_bool, check_int, check_type, fail

# H and I: whole scale groups of 32 (SPEC §1, §8: gpt-oss's 2880 = 90 x 32). The fused layer's exact
# mode takes them too (padded inside its layouts); its fast mode and the GEMM entry points take
# multiples of 512 and 128 and say so themselves.
HIDDEN_MULTIPLE = 32
INTERMEDIATE_MULTIPLE = 32

# The expert MLP's activation (SPEC §3 D6, and §8's gpt-oss variant).
ACTIVATIONS = ("swiglu", "swiglu_oai")
# §8's parameters as gpt-oss sets them. The glu factor's tables (reference/silu_tables.py) are made
# for one alpha, so this is the only alpha a layer takes (a project choice: docs/SPEC.md §8).
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


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
    fast_math: bool = True  # selects the SiLU table (SPEC §3 D6 step 3), or the glu table (§8)
    activation: str = "swiglu"  # "swiglu" (SPEC §3) or "swiglu_oai" (gpt-oss, §8)
    alpha: float = GPT_OSS_ALPHA  # §8's alpha; read only by "swiglu_oai"
    limit: float = GPT_OSS_LIMIT  # §8's clamp bound L; read only by "swiglu_oai"

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def local_experts(self) -> int:  # E_l
        return self.num_experts // self.num_ranks

    def owner(self, expert: int) -> int:
        return expert // self.local_experts

    def to_dict(self) -> dict:
        return asdict(self)


# The fields that are counts: ints, never a float or a string that happens to compare.
INT_FIELDS = ("hidden", "intermediate", "num_experts", "top_k", "num_ranks", "max_tokens_per_rank", "block_m")


def check_activation_clamp(c, arg: str = "activation_clamp") -> None:
    """SPEC §2: None (no clamp) or a number c > 0 (a bool or a string is no number)."""
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
        fail(arg, "None or a positive number", repr(c))


def check_activation(activation, alpha, limit, activation_clamp) -> None:
    """SPEC §8: the activation's name and, for "swiglu_oai", its alpha and limit (which "swiglu"
    leaves at their defaults: a layer that sets them is not the one it thinks it is)."""
    if activation not in ACTIVATIONS:
        fail("activation", f"one of {', '.join(map(repr, ACTIVATIONS))}", repr(activation))
    if activation == "swiglu":
        for arg, value, default in (("alpha", alpha, GPT_OSS_ALPHA), ("limit", limit, GPT_OSS_LIMIT)):
            if value != default:
                fail(arg, f"its default {default} with activation 'swiglu' (only 'swiglu_oai' reads it)", repr(value))
        return
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha != GPT_OSS_ALPHA:
        fail("alpha", f"{GPT_OSS_ALPHA} (the alpha the glu tables are made for)", repr(alpha))
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < float("inf"):
        fail("limit", "a positive finite number", repr(limit))
    if activation_clamp is not None:
        fail("activation_clamp", "None with activation 'swiglu_oai' (its limit clamps)", repr(activation_clamp))


def check_config(cfg: MoEConfig) -> None:
    """The shape and mode fields (SPEC §7); MoEConfig runs it on every construction."""
    check_type("cfg", cfg, MoEConfig)
    for name in INT_FIELDS:
        check_int(name, getattr(cfg, name), minimum=None)
    check_bool("fast_math", cfg.fast_math)
    check_activation_clamp(cfg.activation_clamp)
    check_activation(cfg.activation, cfg.alpha, cfg.limit, cfg.activation_clamp)
    if cfg.hidden <= 0 or cfg.hidden % HIDDEN_MULTIPLE:
        fail("hidden", f"a positive multiple of {HIDDEN_MULTIPLE}", cfg.hidden)
    if cfg.intermediate <= 0 or cfg.intermediate % INTERMEDIATE_MULTIPLE:
        fail("intermediate", f"a positive multiple of {INTERMEDIATE_MULTIPLE}", cfg.intermediate)
    if cfg.num_ranks <= 0:
        fail("num_ranks", "a positive rank count", cfg.num_ranks)
    if cfg.num_experts <= 0 or cfg.num_experts % cfg.num_ranks:
        fail("num_experts", f"a positive multiple of num_ranks = {cfg.num_ranks}", cfg.num_experts)
    if not 0 < cfg.top_k <= cfg.num_experts:
        fail("top_k", f"a value in [1, {cfg.num_experts}]", cfg.top_k)
    if cfg.max_tokens_per_rank < 0:
        fail("max_tokens_per_rank", "a non-negative count", cfg.max_tokens_per_rank)
    if cfg.block_m <= 0 or cfg.block_m % 8:
        fail("block_m", "a positive multiple of 8", cfg.block_m)


# The main job's default: small enough for the CPU reference to run in seconds.
DEFAULT_CONFIG = MoEConfig(
    hidden=1024, intermediate=512, num_experts=16, top_k=4, num_ranks=2, max_tokens_per_rank=128, block_m=64
)
