"""The dump-point table: every dump point D1-D10 of SPEC §3 and every tensor a dump holds for it,
defined once. The reference pipeline, the conformance suite, the fault catalog, the tolerance
report and a kernel's dump code name dump tensors through this module, never by string:

    from megamoe.reference import points as P

    dump[P.D4_POOL_X]                  # the tensor "D4.pool_x"
    P.TABLE[P.D4_POOL_X].dtype         # torch.uint8
    P.TABLE[P.D4_POOL_X].shape         # "P, H"
    P.check_dump_tensors(dump, P.dump_dims(cfg, tokens=T, pool_rows=P_rows))

A dump tensor's name is "<point>.<tensor>"; its constant is the same name in capitals with the
dot written as "_" (D4_POOL_X). Each point has a constant of its own (D4 = "D4").

Shapes are written in SPEC's notation, as the workspace regions of megamoe/jit/contract.py are:
H, I, E, E_l, K, R, T_max of the config, T = this rank's tokens in the call, P = the pool rows of
the call (the last entry of D4.expert_offsets), B = P / BLOCK_M (pool blocks), and C = the kernel's
counter words (any length unless the dims name it; a reference dump has none).

Check classes (SPEC §4), how the suite judges a tensor: EXACT (bytes), MULTISET (a collection
compared after sorting), GEMM_BOUND (|acc - exact| <= τ Σ|ab|) or GEMM_EXACT (grid-snapped inputs),
END_TO_END (y against the float64 oracle, reported only), and GUARD (a check that could not fail
fails instead; any tensor may get one, so the table does not list it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .config import MoEConfig
from .errors import check_int, check_type, fail

# The check classes of SPEC §4 (megamoe.conformance.result takes them from here).
EXACT, MULTISET, GEMM_BOUND, GEMM_EXACT, END_TO_END, GUARD = (
    "EXACT",
    "MULTISET",
    "GEMM_BOUND",
    "GEMM_EXACT",
    "END_TO_END",
    "GUARD",
)

# Dims a shape may name that a caller need not give: the kernel decides them (see the docstring).
FREE_DIMS = ("C",)


@dataclass(frozen=True)
class DumpPoint:
    name: str  # "D4"
    stage: str  # the stage of SPEC §3 that writes it: dispatch, pool, L1, SwiGLU/requant, L2, combine, cleanup
    doc: str


@dataclass(frozen=True)
class DumpTensor:
    name: str  # "D4.pool_x"
    point: str  # "D4"
    stage: str  # "pool"
    dtype: torch.dtype
    shape: str  # SPEC notation: "P, H"
    checks: tuple[str, ...]  # the check classes the suite judges it with (GUARD aside)
    doc: str

    def shape_of(self, dims: Mapping[str, int]) -> tuple[int | None, ...]:
        """The shape for the given dims; None for an axis of a free dim (FREE_DIMS) not given."""
        return shape_of(self.shape, dims, what=self.name)


def shape_of(shape: str, dims: Mapping[str, int], *, what: str = "a shape") -> tuple[int | None, ...]:
    """A shape written in SPEC notation ("P, H // 32", "E_l + 1") for the given dims: the one
    reader of this table's shapes and of the fused kernel's workspace regions
    (megamoe.jit.contract.WORKSPACE). An axis of a free dim (FREE_DIMS) not given is None."""
    out: list[int | None] = []
    for axis in shape.split(","):
        symbols = [w for w in axis.replace("/", " ").replace("*", " ").replace("+", " ").split() if _is_dim(w)]
        unknown = [s for s in symbols if s not in dims]
        if unknown and all(s in FREE_DIMS for s in unknown):
            out.append(None)
            continue
        if unknown:
            raise ValueError(f"{what} has shape [{shape}]: the dims given lack {', '.join(unknown)}")
        out.append(int(eval(axis, {"__builtins__": {}}, dict(dims))))  # noqa: S307 (the tables' own strings)
    return tuple(out)


def config_dims(cfg: MoEConfig) -> dict[str, int]:
    """The sizes a layer's configuration fixes, by their SPEC names (H, I, E, E_l, K, R, T_max):
    those of the dump tensors' shapes (`dump_dims`) and of the workspace's regions."""
    check_type("cfg", cfg, MoEConfig)
    return {
        "H": cfg.hidden,
        "I": cfg.intermediate,
        "E": cfg.num_experts,
        "E_l": cfg.local_experts,
        "K": cfg.top_k,
        "R": cfg.num_ranks,
        "T_max": cfg.max_tokens_per_rank,
    }


def _is_dim(word: str) -> bool:
    return word[0].isalpha() or word[0] == "_"


_POINTS: list[DumpPoint] = []
_TENSORS: list[DumpTensor] = []


def _point(name: str, stage: str, doc: str) -> str:
    _POINTS.append(DumpPoint(name, stage, doc))
    return name


def _tensor(name: str, dtype: torch.dtype, shape: str, checks: str | tuple[str, ...], doc: str) -> str:
    point = name.partition(".")[0]
    stage = next(p.stage for p in _POINTS if p.name == point)
    checks = (checks,) if isinstance(checks, str) else checks
    _TENSORS.append(DumpTensor(name, point, stage, dtype, shape, checks, doc))
    return name


# ------------------------------------------------------------------------ the table (SPEC §3)

D1 = _point("D1", "dispatch", "send counts")
D2 = _point("D2", "dispatch", "receive counts")
D3 = _point("D3", "dispatch", "source lists")
D4 = _point("D4", "pool", "pulled rows, scales, routing weights, metadata, arrival counts")
D5 = _point("D5", "L1", "fp32 accumulators")
D6 = _point("D6", "SwiGLU/requant", "FP8 intermediate, scale bytes, L1 completion")
D7 = _point("D7", "L2", "fp32 accumulators")
D8 = _point("D8", "L2", "bf16 combine rows")
D9 = _point("D9", "combine", "y")
D10 = _point("D10", "cleanup", "counters clean, cumulative statistics")

D1_SEND_COUNTS = _tensor(
    "D1.send_counts", torch.int32, "E", EXACT, "token slots of this rank routed to each global expert"
)
D2_RECV_COUNTS = _tensor(
    "D2.recv_counts", torch.int32, "R, E_l", EXACT, "slots from each source rank to each local expert"
)
D2_RECV_TOTALS = _tensor(
    "D2.recv_totals", torch.int32, "E_l", EXACT, "N_e: slots received by each local expert from all ranks"
)
D3_SOURCE_LISTS = _tensor(
    "D3.source_lists",
    torch.int32,
    "E_l, R, T_max",
    MULTISET,
    "t*K + k of each (local expert, source rank) pair, ascending, padded with -1",
)
D4_POOL_X = _tensor(
    "D4.pool_x", torch.uint8, "P, H", EXACT, "pulled token rows (E4M3 codes), experts in order, BLOCK_M-aligned"
)
D4_POOL_X_SF = _tensor("D4.pool_x_sf", torch.uint8, "P, H // 32", EXACT, "their UE8M0 scale bytes, one per 32")
D4_POOL_WEIGHTS = _tensor("D4.pool_weights", torch.float32, "P", EXACT, "their routing weights, bit copies")
D4_POOL_META = _tensor(
    "D4.pool_meta", torch.int32, "P, 3", MULTISET, "(source rank, token, slot) of each row; -1 on padding rows"
)
D4_EXPERT_OFFSETS = _tensor(
    "D4.expert_offsets", torch.int32, "E_l + 1", EXACT, "first pool row of each local expert, then P"
)
D4_BLOCK_ARRIVALS = _tensor("D4.block_arrivals", torch.int32, "B", EXACT, "valid rows pulled into each pool block")
D5_ACC1 = _tensor(
    "D5.acc1",
    torch.float32,
    "P, 2 * I",
    (GEMM_BOUND, GEMM_EXACT),
    "L1 accumulators: gate channels [0, I), up channels [I, 2I)",
)
D6_L2_ACTS = _tensor("D6.l2_acts", torch.uint8, "P, I", EXACT, "the E4M3 intermediate, natural channel order")
D6_L2_SF = _tensor("D6.l2_sf", torch.uint8, "P, I // 32", EXACT, "its UE8M0 scale bytes (RCEIL), one per 32")
D6_L1_DONE = _tensor(
    "D6.l1_done", torch.int32, "B", EXACT, "L1 completion of each pool block: I/32 with valid rows, else 0"
)
D7_ACC2 = _tensor("D7.acc2", torch.float32, "P, H", (GEMM_BOUND, GEMM_EXACT), "L2 accumulators")
D8_COMBINE = _tensor(
    "D8.combine", torch.bfloat16, "K, T_max, H", EXACT, "this rank's combine buffer: bf16(acc2) of slot k of token t"
)
D9_Y = _tensor("D9.y", torch.bfloat16, "T, H", (EXACT, END_TO_END), "the layer's output")
D10_RECV_STATS = _tensor(
    "D10.recv_stats", torch.int64, "E_l", EXACT, "cumulative receive statistics after the call (before + N_e)"
)
D10_COUNTERS = _tensor("D10.counters", torch.int32, "C", EXACT, "every per-call counter word after the call, all zero")

# ------------------------------------------------------------------------ views of the table

POINTS: tuple[str, ...] = tuple(p.name for p in _POINTS)  # pipeline order
POINT: dict[str, DumpPoint] = {p.name: p for p in _POINTS}
TABLE: dict[str, DumpTensor] = {t.name: t for t in _TENSORS}  # pipeline order
NAMES: tuple[str, ...] = tuple(TABLE)
STAGES: tuple[str, ...] = tuple(dict.fromkeys(p.stage for p in _POINTS))


def stage_of(point: str) -> str:
    """The stage that writes dump point `point` ("D6" -> "SwiGLU/requant")."""
    return POINT[point].stage


def tensors_of(point: str) -> tuple[str, ...]:
    """The names of the tensors of dump point `point`, in table order."""
    return tuple(t.name for t in _TENSORS if t.point == point)


def dump_dims(cfg: MoEConfig, *, tokens: int, pool_rows: int, counter_words: int | None = None) -> dict[str, int]:
    """The dims the table's shapes are written in, for one rank of one call: `tokens` is T (this
    rank's x.shape[0]), `pool_rows` is P (the last entry of its D4.expert_offsets), and
    `counter_words`, when given, is C (the length of D10.counters; 0 for a reference dump)."""
    check_type("cfg", cfg, MoEConfig)
    check_int("tokens", tokens, 0)
    check_int("pool_rows", pool_rows, 0)
    if counter_words is not None:
        check_int("counter_words", counter_words, 0)
    dims = {
        **config_dims(cfg),
        "T": int(tokens),
        "P": int(pool_rows),
        "B": int(pool_rows) // cfg.block_m,
    }
    if counter_words is not None:
        dims["C"] = int(counter_words)
    return dims


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dump_problems(
    tensors: Mapping[str, torch.Tensor], dims: Mapping[str, int], points: Iterable[str] | None = None
) -> list[str]:
    """What keeps `tensors` from being a dump of the table (of `points`, default all), one line per
    problem naming the tensor: missing, not a tensor, wrong dtype, wrong shape, or a dump-point name
    the table does not know. Names outside D1-D10 (inputs.*, weights.*) are not judged."""
    check_type("tensors", tensors, Mapping)
    check_type("dims", dims, Mapping)
    wanted = POINTS if points is None else tuple(points)
    unknown_points = [p for p in wanted if p not in POINT]
    if unknown_points:
        fail("points", f"dump points of the table ({', '.join(POINTS)})", ", ".join(map(str, unknown_points)))
    problems = []
    for name in tensors:
        point, dot, _ = name.partition(".")
        if dot and point in POINT and name not in TABLE:
            problems.append(
                f"{name}: not a tensor of the dump-point table (point {point} has {', '.join(tensors_of(point))})"
            )
    for t in _TENSORS:
        if t.point not in wanted:
            continue
        if t.name not in tensors:
            problems.append(f"{t.name}: missing ({_dtype_name(t.dtype)} [{t.shape}])")
            continue
        got = tensors[t.name]
        if not isinstance(got, torch.Tensor):
            problems.append(f"{t.name}: a {type(got).__name__}, not a tensor")
            continue
        if got.dtype != t.dtype:
            problems.append(f"{t.name}: dtype {_dtype_name(got.dtype)}, expected {_dtype_name(t.dtype)}")
        want = t.shape_of(dims)
        if len(want) != got.dim() or any(w is not None and w != g for w, g in zip(want, got.shape)):
            shown = ", ".join("*" if w is None else str(w) for w in want)
            problems.append(f"{t.name}: shape {list(got.shape)}, expected [{shown}] = [{t.shape}]")
    return problems


def check_dump_tensors(
    tensors: Mapping[str, torch.Tensor], dims: Mapping[str, int], points: Iterable[str] | None = None
) -> None:
    """Raise ValueError naming every tensor of `tensors` that does not match the table (names,
    dtypes, shapes for `dims`, see dump_dims); for a kernel's dump dict before it is saved or checked."""
    problems = dump_problems(tensors, dims, points)
    if problems:
        raise ValueError(
            f"{len(problems)} dump tensor(s) do not match the dump-point table (megamoe.reference.points):\n  "
            + "\n  ".join(problems)
        )
