"""The host <-> kernel contract has one definition (megamoe/jit/contract.py): the committed C++
header is exactly what it generates, the packer puts every field at the offset the header's
static_asserts pin, the generated workspace accessors find each element where the host's layout puts
it, and the workspace's pool holds the worst routing all peers can send. CPU only."""

import math
import re
import struct
import subprocess
import sys

import pytest
import torch

from megamoe import reference as ref
from megamoe.jit import build as jb
from megamoe.jit import contract


def test_committed_contract_header_is_what_the_python_definition_generates():
    # The command CI and a developer run; its output names the file when it is stale.
    run = subprocess.run([sys.executable, "-m", "megamoe.jit.contract", "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert contract.header_path().read_text() == contract.header()


def test_the_contract_check_names_a_stale_header_and_exits_1_without_writing(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "contract.cuh"
    stale.write_text("// an older header\n")
    monkeypatch.setattr(contract, "header_path", lambda: stale)
    assert contract.main(["--check"]) == 1
    assert capsys.readouterr().out.strip() == f"{stale} is stale: run python -m megamoe.jit.contract --write"
    assert stale.read_text() == "// an older header\n"
    assert contract.main(["--write"]) == 0 and stale.read_text() == contract.header()
    assert contract.main(["--check"]) == 0


def test_the_contract_command_without_a_mode_prints_its_usage_and_writes_nothing(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "contract.cuh"
    stale.write_text("// an older header\n")
    monkeypatch.setattr(contract, "header_path", lambda: stale)
    with pytest.raises(SystemExit) as exc:
        contract.main([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m megamoe.jit.contract [-h] [--check | --write]"), err
    assert stale.read_text() == "// an older header\n"
    with pytest.raises(SystemExit) as exc:
        contract.main(["--help"])
    assert exc.value.code == 0 and "--check" in capsys.readouterr().out


def test_committed_wgmma_wrappers_are_what_gen_wgmma_writes():
    import importlib.util

    from megamoe.kernel import KERNEL_DIR

    spec = importlib.util.spec_from_file_location("gen_wgmma", KERNEL_DIR / "gemm" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for form in gen.FORMS:
        assert gen.header_path(form).read_text() == gen.header(form), (
            f"{gen.header_path(form).name} is stale: run python3 kernel/gemm/gen_wgmma.py"
        )


def test_the_tile_limits_name_every_promotion_and_are_token_tiles():
    for limits in (contract.MAX_TILE, contract.MAX_WGS4_TILE):
        assert set(limits) == set(jb.PROMOTIONS)
        assert all(t in contract.TOKEN_TILES for t in limits.values())
    assert all(contract.MAX_WGS4_TILE[p] <= contract.MAX_TILE[p] for p in jb.PROMOTIONS)
    assert max(contract.MAX_TILE.values()) == contract.TOKEN_TILES[-1]


def test_packed_parameters_put_each_field_at_its_offset():
    values = {f.name: (bytes([i]) * 128 if f.kind == "tmap" else 1000 + i) for i, f in enumerate(contract.PARAMS)}
    values["clamp_value"] = 1.5
    b = contract.pack_params(**values)
    assert len(b) == contract.PARAMS_BYTES
    for i, f in enumerate(contract.PARAMS):
        o = contract.OFFSETS[f.name]
        if f.kind == "tmap":
            assert b[o : o + 128] == bytes([i]) * 128
        elif f.kind == "ptr":
            assert struct.unpack_from("<Q", b, o)[0] == 1000 + i
        elif f.kind == "i32":
            assert struct.unpack_from("<i", b, o)[0] == 1000 + i
    assert struct.unpack_from("<f", b, contract.OFFSETS["clamp_value"])[0] == 1.5


def test_the_trap_record_is_read_by_the_field_names_the_kernel_writes():
    """The kernel writes a TrapRecord by field (ptx.cuh report_trap); the host reads the same words by
    the same names (contract.TRAP_RECORD), from a buffer of the record's size (runtime.err_record)."""
    from megamoe import runtime

    rec = contract.TRAP_RECORD
    assert rec.size == 32 and rec.offsets["state"] == 0
    words = [0] * (rec.size // 4)
    values = dict(state=1, what=5, block=17, index=9, expected=64, observed=40, thread=3)
    for name, v in values.items():
        words[rec.offsets[name] // 4] = v
    assert runtime._record_words(words) == (
        "SM block 17 thread 3: waited for L1 completion counter of pool block 9: expected 64, observed 40"
    )
    words[rec.offsets["state"] // 4] = 2  # claimed, the completion flag not seen
    assert runtime._record_words(words).endswith("(record claimed, completion flag not seen)")
    assert "struct TrapRecord {" in contract.header()


def test_packing_refuses_a_missing_or_unknown_field():
    values = {f.name: (bytes(128) if f.kind == "tmap" else 0) for f in contract.PARAMS}
    with pytest.raises(KeyError, match="missing"):
        contract.pack_params(**{k: v for k, v in values.items() if k != "err"})
    with pytest.raises(KeyError, match="unknown"):
        contract.pack_params(**values, bogus=1)


def test_the_scaled_tables_are_exact_within_fourteen_binades_and_zero_from_nineteen():
    from megamoe.reference import formats as F
    from megamoe.reference import quantize as Q

    lut = F.decode_e4m3(Q.scaled_fp4_lut()).double()
    mags = F.decode_e2m1(__import__("torch").arange(8, dtype=__import__("torch").uint8)).double()
    for d in range(Q.FAST_LUT_ENTRIES):
        want = mags * 2.0 ** (Q.FAST_LUT_HEADROOM - d)
        if d <= Q.FAST_EXACT_BINADES:
            assert (lut[d] == want).all(), d
        else:
            assert not (lut[d] == want).all(), d
    assert (lut[Q.FAST_LUT_ENTRIES - 1] == 0).all() and (lut[Q.FAST_LUT_ENTRIES - 2] != 0).any()


@pytest.mark.parametrize(
    "ranks,experts,top_k,t_max", [(1, 16, 4, 128), (2, 16, 8, 100), (4, 16, 8, 64), (8, 256, 8, 33)]
)
def test_the_pool_holds_the_worst_routing_that_every_peer_together_can_send(ranks, experts, top_k, t_max):
    # SPEC §6: sized for all tokens of all ranks routed here, never from this rank's T. Every rank
    # sends every token to min(K, E_l) of rank 0's experts (the rest elsewhere), in patterns that
    # spread or pile the rows and leave the experts' counts at every residue modulo BLOCK_M.
    cfg = ref.MoEConfig(
        hidden=256, intermediate=128, num_experts=experts, top_k=top_k, num_ranks=ranks, max_tokens_per_rank=t_max
    )
    e_l, bm = cfg.local_experts, cfg.block_m
    here = min(top_k, e_l)
    rows_bound = contract.workspace_dims(cfg)["P"]
    worst = 0
    for shift in range(0, e_l, max(1, e_l // 4)):
        for tokens in (t_max, t_max - 1, max(1, t_max // 2 + 1)):
            t = torch.arange(tokens)[:, None]
            mine = (t * shift + t // 3 + torch.arange(here)) % e_l  # distinct within a token
            rest = (e_l + (t + torch.arange(top_k - here)) % (experts - e_l)) if top_k > here else mine[:, :0]
            idx = torch.cat([mine, rest], dim=1)
            counts = sum(ref.send_counts(idx, experts)[:e_l] for _ in range(ranks))
            assert int(counts.max()) <= ranks * t_max  # an expert at most once per token
            worst = max(worst, int(ref.pool_offsets(counts.tolist(), bm)[-1]))
            if tokens == t_max:
                assert int(counts.sum()) == ranks * t_max * here  # the bound's valid rows are reached
    assert worst <= rows_bound, (worst, rows_bound)
    assert rows_bound < ranks * t_max * here + e_l * bm + bm  # and it is no looser than padding


def _generated_accessors() -> dict[str, tuple[list[str], str, list[str]]]:
    """The generated header's workspace accessors, read from its text: {region: (the index function's
    parameters, its expression, the arguments ws_<region>(p, ...) passes it)}."""
    found = {}
    pattern = re.compile(
        r"(?:int|int64_t) ws_(\w+)_index\(([^)]*)\) \{\n  return (.*);\n\}\n"
        r"__device__ __forceinline__ \w+& ws_\1\(const FusedParams& p, [^)]*\) \{\n"
        r"  return p\.ws_\1\[ws_\1_index\(([^)]*)\)\];"
    )
    for m in pattern.finditer(contract.header_path().read_text()):
        params = [a.split()[-1] for a in m.group(2).split(", ")]
        found[m.group(1)] = (params, m.group(3), m.group(4).split(", "))
    return found


@pytest.mark.parametrize(
    "hidden,inter,experts,top_k,ranks,t_max",
    [
        (256, 128, 16, 4, 1, 128),
        (512, 256, 16, 8, 2, 100),
        (7168, 2048, 256, 8, 8, 33),
        (3072, 1536, 128, 4, 4, 4096),
        (2880, 2880, 32, 4, 2, 64),  # gpt-oss: the pool and the intermediate padded to 2944
    ],
)
def test_each_workspace_accessor_finds_the_element_where_the_host_layout_puts_it(
    hidden, inter, experts, top_k, ranks, t_max
):
    # The kernel's generated arithmetic (its C++ text, evaluated here) against workspace_layout's
    # offsets and row-major shapes, with FusedParams' sizes as the host fills them: the first,
    # last and a middle element of every multi-dimensional region, as a byte offset in the workspace.
    cfg = ref.MoEConfig(
        hidden=hidden, intermediate=inter, num_experts=experts, top_k=top_k, num_ranks=ranks, max_tokens_per_rank=t_max
    )
    layout, total = contract.workspace_layout(cfg)
    dims = contract.workspace_dims(cfg)
    p = {field: dims[dim] for dim, field in contract.DIM_FIELDS.items()}  # as the launcher fills them
    assert (p["hidden"], p["intermediate"], p["local_experts"]) == (hidden, inter, experts // ranks)
    accessors = _generated_accessors()
    regions = [r.name for r in contract.WORKSPACE if len(layout[r.name][2]) > 1]
    assert sorted(accessors) == sorted(regions)
    for name in regions:
        off, dtype, shape = layout[name]
        params, expr, call = accessors[name]
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
        # The sizes ws_<region>(p, ...) reads from FusedParams, by the index function's names.
        sizes = {n: p[a.removeprefix("p.")] for n, a in zip(params[len(shape) :], call[len(shape) :])}
        for index in (tuple(0 for _ in shape), tuple(d - 1 for d in shape), tuple(d // 2 for d in shape)):
            want = off + sum(i * st for i, st in zip(index, strides)) * size
            flat = eval(expr.replace("/", "//"), {}, {**sizes, **dict(zip(params, index))})  # noqa: S307
            assert off + flat * size == want, (name, index, expr, sizes)
            assert off <= want < off + math.prod(shape) * size <= total


def test_every_kernel_source_names_its_promotion_as_the_python_side_spells_it():
    # One name per knob: the instantiation units take Promotion::k32 / ::k128 (the generated enum,
    # in contract.PROMOTIONS' order), never a bool spelled by the build.
    from megamoe import heuristics

    enum = ", ".join(f"{p} = {i}" for i, p in enumerate(contract.PROMOTIONS))
    assert f"enum class Promotion : int {{ {enum} }};" in contract.header_path().read_text()
    assert jb.PROMOTIONS is contract.PROMOTIONS
    for spec in heuristics.used_specs() + heuristics.fused_specs():
        src = spec.source()
        assert f"kPerK32 = megamoe::per_k32(megamoe::Promotion::{spec.promotion});" in src, spec.name
        assert not re.search(r"@\w+@", src), spec.name


def test_a_debug_calls_read_checks_that_the_pool_and_intermediate_padding_is_still_zero():
    # SPEC §8's sizes (H = 160, I = 96): the pool's and the intermediate's rows are padded to 256 and
    # 128 columns; a non-zero byte there (which L1 or L2 would multiply by a zero weight: NaN for a
    # NaN code) fails the read of a debug call's dumps, naming the region.
    from megamoe.moe import _Workspace, workspace_points

    cfg = ref.MoEConfig(hidden=160, intermediate=96, num_experts=4, top_k=2, num_ranks=1, max_tokens_per_rank=16)
    layout, total = contract.workspace_layout(cfg)
    ws = _Workspace(torch.zeros(total, dtype=torch.uint8), layout)
    ws["expert_offsets"].copy_(torch.tensor([0, 64, 64, 64, 128], dtype=torch.int32))
    assert ws["pool_x"].shape[1] == 256 and ws["l2_acts"].shape[1] == 128
    points = workspace_points(ws, cfg)
    assert points["D4.pool_x"].shape == (128, 160) and points["D6.l2_acts"].shape == (128, 96)
    for region, column in (("pool_x", 200), ("pool_x_sf", 6), ("l2_acts", 100), ("l2_sf", 3)):
        ws[region][5, column] = 1
        with pytest.raises(RuntimeError, match=f"workspace's {region} has non-zero padding"):
            workspace_points(ws, cfg)
        ws[region][5, column] = 0
    ws["l2_acts"][200, 100] = 1  # past the used pool rows: not read
    workspace_points(ws, cfg)


def test_each_workspace_region_a_dump_reads_has_its_dump_tensors_dtype_and_shape():
    # The two tables (the workspace's regions and the dump points) meet in these links only.
    from megamoe.reference import points as P

    cfg = ref.MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=2, num_ranks=2, max_tokens_per_rank=24)
    dims = contract.workspace_dims(cfg)
    linked = [r for r in contract.WORKSPACE if r.dump]
    assert len({r.dump for r in linked}) == len(linked)
    for r in linked:
        t = P.TABLE[r.dump]
        assert str(t.dtype).removeprefix("torch.") == r.dtype, r.name
        want = P.shape_of(t.shape, dict(dims, T=cfg.max_tokens_per_rank), what=t.name)
        assert P.shape_of(r.shape, dims) == want, (r.name, r.shape, t.shape)


def test_a_debug_calls_dump_tensors_are_read_from_the_workspace_by_those_links():
    from megamoe.moe import _Workspace, workspace_points
    from megamoe.reference import points as P

    cfg = ref.MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=2, num_ranks=2, max_tokens_per_rank=24)
    layout, total = contract.workspace_layout(cfg)
    ws = _Workspace(
        torch.randint(0, 255, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)), layout
    )
    # a call that used 3 of the pool's blocks: experts at rows 0, 64, 64, 128, then 192
    ws["expert_offsets"].copy_(torch.tensor([0, 64, 64, 128, 192], dtype=torch.int32))
    ws["recv_counts"].copy_(torch.tensor([[3, 0, 24, 1], [0, 5, 2, 24]], dtype=torch.int32))
    points = workspace_points(ws, cfg)
    assert torch.equal(points[P.D4_POOL_X], ws["pool_x"][:192])
    assert torch.equal(points[P.D4_BLOCK_ARRIVALS], ws["snap_arrivals"][:3])
    assert torch.equal(points[P.D8_COMBINE].view(torch.int16), ws["combine"].view(torch.int16))  # random bytes: NaNs
    lists = points[P.D3_SOURCE_LISTS]  # [E_l, R, T_max]: -1 past each pair's count
    assert (lists[0, 0, 3:] == -1).all() and torch.equal(lists[0, 0, :3], ws["source_lists"][0, 0, :3])
    assert (lists[1, 0] == -1).all() and torch.equal(lists[2, 0], ws["source_lists"][2, 0])
    # every tensor of the table but the four the layer adds itself, each of its dtype and shape
    rest = {P.D5_ACC1, P.D7_ACC2, P.D9_Y, P.D10_COUNTERS}
    assert set(points) == set(P.NAMES) - rest
    dims = P.dump_dims(cfg, tokens=24, pool_rows=192)
    problems = [p for p in P.dump_problems(points, dims) if not any(n in p for n in rest)]
    assert not problems, problems
