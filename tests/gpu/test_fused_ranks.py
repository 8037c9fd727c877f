"""The fused layer on R = 2 and 4 ranks, and 8 on a machine of 8 GPUs (expert parallelism through
symmetric memory, SPEC §6), run as R processes by megamoe.multirank.spawn (sharing one GPU, or one
GPU each where there are enough): every dump point of every rank through the conformance suite, on
uniform and skewed routings, uneven T per rank, T = 0 on one rank, one hot expert that receives
every token of every rank, masked slots, clamp on and off, both SiLU modes and both GEMM modes; y
of a global batch split over 1, 2, 4 (and 8) ranks bitwise the same; 20 repeats the same bits; one
rank's bad input refused on every rank before a launch; one rank's failed predecode fails every
rank's constructor.

Each R is one spawn that runs every case (a process start and the kernels' loading are most of a
case's cost on one time-sliced GPU); the tests then check what the ranks returned. Under
pytest-xdist one worker runs each spawn and the others read its results (runs_dir).

Run: pytest -s tests/gpu/test_fused_ranks.py"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import torch

from megamoe import multirank
from megamoe import reference as ref
from megamoe.conformance.suite import check
from megamoe.jit import build as jb
from megamoe.launchers import FusedLauncher
from megamoe.moe import MegaMoE

SHAPE = dict(hidden=1024, intermediate=512, num_experts=16, top_k=4, max_tokens_per_rank=128, block_m=64)
WEIGHT_SEED = 3

# name: (tokens per rank, a function of R; distribution; masked ratio; call options)
CASES = {
    "uniform": (lambda r: [128] * r, "uniform", 0.0, dict()),
    "uneven-skewed-clamp": (
        lambda r: [max(1, 100 - 30 * i) for i in range(r)],
        "skewed",
        0.1,
        dict(activation_clamp=1.5),
    ),
    "one-rank-empty": (lambda r: [0] + [77] * (r - 1), "uniform", 0.0, dict(fast_math=False)),
    "hot-expert": (lambda r: [128] * r, "one_hot", 0.0, dict()),
    "masked": (lambda r: [64] * r, "empty_experts", 0.5, dict(activation_clamp=0.75, fast_math=False)),
    "all-masked": (lambda r: [32] * r, "uniform", 1.0, dict()),
}
GLOBAL_TOKENS = 128  # the split-batch case: T_max tokens, so that one rank can take them all


def _cfg(ranks: int) -> ref.MoEConfig:
    return ref.MoEConfig(**SHAPE, num_ranks=ranks)


def _weights() -> ref.ExpertWeights:
    return ref.random_weights(
        SHAPE["num_experts"], SHAPE["hidden"], SHAPE["intermediate"], seed=WEIGHT_SEED, device="cuda"
    )


def _global_batch() -> ref.RankInputs:
    return ref.make_inputs(_cfg(1), GLOBAL_TOKENS, seed=7, distribution="skewed", masked_ratio=0.1, device="cuda")[0]


def _every_case(rank: int, ranks: int, promotion: str, engine: str = "auto") -> dict:
    """One rank's part of every case (runs in a spawned process)."""
    cfg = _cfg(ranks)
    layer = MegaMoE(cfg, _weights(), group=multirank.group(), promotion=promotion, engine=engine)
    with layer.named_failures():  # a wait that timed out is named in the rank's error
        return _cases_on(layer, cfg, rank, ranks)


def _cases_on(layer: MegaMoE, cfg: ref.MoEConfig, rank: int, ranks: int) -> dict:
    out: dict = {}
    for seed, (name, (tokens, distribution, masked, opts)) in enumerate(CASES.items()):
        inp = ref.make_inputs(cfg, tokens(ranks), seed=seed, distribution=distribution, masked_ratio=masked)[rank]
        inp = inp.to("cuda")
        y, dumps = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, debug=True, **opts)
        out[name] = (y.cpu(), dumps[0].without_weights(WEIGHT_SEED))
    # A global batch split over the ranks, then 20 release calls of it.
    mine = ref.split_global_batch(_global_batch(), ranks)[rank]
    ys = [layer(mine.x, mine.x_sf, mine.topk_idx, mine.topk_weights) for _ in range(20)]
    out["split"] = ys[0].cpu()
    out["repeats_equal"] = all(torch.equal(y.view(torch.int16), ys[0].view(torch.int16)) for y in ys)
    # One rank's bad input (a duplicate expert on the last rank) is refused on every rank.
    bad = mine.topk_idx.clone()
    if rank == ranks - 1:
        bad[0, :2] = 0  # expert 0 twice in token 0
    before = layer.ws.buffer.clone()
    try:
        layer(mine.x, mine.x_sf, bad, mine.topk_weights)
        out["refused"] = None
    except ref.MegaMoEInputError as e:
        out["refused"] = str(e)
    torch.cuda.synchronize()
    out["untouched"] = torch.equal(layer.ws.buffer, before)
    return out


_RUNS: dict = {}


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    """Where this session keeps the spawns' results: pytest-xdist's workers share the parent of their
    own temporary directories (its documented pattern for once-a-session work), one process its own.
    Each worker used to spawn every run its tests met: at -n 8 the same run up to eight times on one
    GPU, and tests/gpu/test_fused_ranks.py -k k32 never ended inside a 10-minute call (NOTES v44)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _run(runs_dir: Path, ranks: int, promotion: str, engine: str = "auto") -> list[dict]:
    """The ranks' results of every case of one run: spawned by the first worker that needs them
    (holding the run's file lock, so the others wait for it), read from its file by the others."""
    key = (ranks, promotion, engine)
    if key not in _RUNS:
        path = runs_dir / f"fused_ranks_R{ranks}_{promotion}_{engine}.pt"
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                _RUNS[key] = torch.load(path, weights_only=False)  # our own results of this session
            else:
                _RUNS[key] = multirank.spawn(_every_case, ranks, args=(promotion, engine), timeout=450)
                torch.save(_RUNS[key], path)
    return _RUNS[key]


# R = 2 and 4 everywhere (processes time-slicing one GPU when there is one, a GPU each where there
# are enough); R = 8 too on a machine of 8 GPUs, one process per GPU (the several-H200 run). The
# layer's own engine at these sizes is the swap-AB engine; R = 2 runs the prefill engine too.
RANKS = [2, 4] + ([8] if torch.cuda.device_count() >= 8 else [])
RUNS_OF = [(r, "auto") for r in RANKS] + [(2, "prefill"), (2, "narrow")]
PROMOTIONS = ["k32", "k128"]
# (promotion, ranks, engine): the runs each promotion has (the narrow engine is the exact mode's).
MODES = [(p, r, e) for p in PROMOTIONS for r, e in RUNS_OF if e in ("auto", *jb.FUSED_ENGINES_OF[p])]
MODE_IDS = [f"{p}-R{r}-{e}" for p, r, e in MODES]


@pytest.mark.parametrize("promotion,ranks,engine", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_dump_point_of_every_rank_conforms(ranks, engine, promotion, case, runs_dir):
    per_rank = _run(runs_dir, ranks, promotion, engine)
    dumps = [r[case][1] for r in per_rank]
    tokens, _, masked, _ = CASES[case]
    report = check(dumps, end_to_end=min(tokens(ranks)) > 0 and masked < 1.0)
    print(report.text())
    assert report.ok, report.text()
    for r in per_rank:
        y, d = r[case]
        assert torch.equal(y.view(torch.int16), d["D9.y"].view(torch.int16))


@pytest.mark.parametrize("promotion,engine", jb.FUSED_MODES)
def test_a_global_batch_gives_the_same_bits_on_one_two_and_four_ranks(promotion, engine, runs_dir):
    # One engine's tensor-core sums against its own (the prefill engine's need not equal the swap-AB
    # engines' bitwise; the narrow and swap-AB engines' sums are the same k32 products promoted in the
    # same order, and gave the same y, bench/NOTES.md v34).
    inp = _global_batch()
    one = MegaMoE(_cfg(1), _weights(), promotion=promotion, engine=engine)
    y1 = one(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights).cpu()
    for run_promotion, ranks, run_engine in MODES:  # the runs this promotion has (k128: no narrow engine)
        if run_promotion != promotion or (run_engine == "prefill") != (engine == "prefill"):
            continue
        split = torch.cat([r["split"] for r in _run(runs_dir, ranks, promotion, run_engine)])
        assert torch.equal(split.view(torch.int16), y1.view(torch.int16)), (ranks, run_engine)


@pytest.mark.parametrize("promotion,ranks,engine", MODES, ids=MODE_IDS)
def test_twenty_repeats_on_every_rank_give_the_same_bits(ranks, engine, promotion, runs_dir):
    assert all(r["repeats_equal"] for r in _run(runs_dir, ranks, promotion, engine))


@pytest.mark.parametrize("ranks", RANKS)
def test_one_ranks_bad_input_is_refused_on_every_rank_and_nothing_is_written(ranks, runs_dir):
    per_rank = _run(runs_dir, ranks, "k32")
    last = ranks - 1
    assert "topk_idx" in per_rank[last]["refused"]
    for r in range(last):
        assert per_rank[r]["refused"].startswith(f"rank {last} refused its call"), per_rank[r]["refused"]
    assert all(r["untouched"] for r in per_rank)


def _predecode_fails_on_the_last_rank(rank: int, ranks: int) -> str:
    """One rank's constructor of a predecoded layer whose predecode raises on the last rank (as an
    allocation that ran out of memory would): what the constructor raised, on every rank."""
    if rank == ranks - 1:

        def planted(*args, **kwargs):
            raise torch.OutOfMemoryError(f"planted on rank {rank}")

        FusedLauncher.predecode = planted
    try:
        MegaMoE(_cfg(ranks), _weights(), group=multirank.group(), engine="prefill", predecoded=True)
    except (RuntimeError, torch.OutOfMemoryError) as e:
        return f"{type(e).__name__}: {e}"
    return "constructed"


@pytest.mark.parametrize("ranks", RANKS)
def test_a_rank_whose_predecode_fails_fails_every_ranks_constructor_instead_of_leaving_them_waiting(ranks):
    per_rank = multirank.spawn(_predecode_fails_on_the_last_rank, ranks, timeout=120)
    last = ranks - 1
    assert per_rank[last] == f"OutOfMemoryError: planted on rank {last}"
    for r in range(last):
        assert per_rank[r].startswith(f"RuntimeError: rank {last} refused its call"), per_rank[r]
        assert f"planted on rank {last}" in per_rank[r]


def _padded_sizes(rank: int, ranks: int, engine: str) -> tuple:
    """One rank's call at SPEC §8's sizes (H = 160, I = 96: multiples of 32, padded inside the
    kernel's layouts) with gpt-oss's activation and biases, and odd token counts: x_sf's T * H / 32
    staged bytes are not whole words, and the peers' scale rows are read byte by byte."""
    cfg = ref.MoEConfig(
        hidden=160,
        intermediate=96,
        num_experts=8,
        top_k=4,
        max_tokens_per_rank=64,
        block_m=64,
        num_ranks=ranks,
        activation="swiglu_oai",
    )
    w = ref.random_weights(8, 160, 96, seed=WEIGHT_SEED)
    w.b1, w.b2 = ref.random_biases(8, 160, 96, seed=WEIGHT_SEED)
    layer = MegaMoE(cfg, w.to("cuda"), group=multirank.group(), promotion="k32", engine=engine)
    inp = ref.make_inputs(cfg, [33, 17, 64, 1][:ranks], seed=5, distribution="skewed")[rank].to("cuda")
    with layer.named_failures():
        y, dumps = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, debug=True)
    return y.cpu(), dumps[0]


@pytest.mark.parametrize("engine", jb.FUSED_ENGINES_OF["k32"])
@pytest.mark.parametrize("ranks", [2])
def test_sizes_in_multiples_of_32_conform_on_every_rank_with_gpt_oss_activation(ranks, engine):
    per_rank = multirank.spawn(_padded_sizes, ranks, args=(engine,), timeout=300)
    report = check([d for _, d in per_rank])
    assert report.ok, report.text()
    for y, d in per_rank:
        assert torch.equal(y.view(torch.int16), d["D9.y"].view(torch.int16))
