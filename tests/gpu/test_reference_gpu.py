"""GPU checks of the reference: the activation tables regenerate bit for bit from the kernel's device
function, the reference gives the same bits on CUDA tensors as on the CPU, and a CUDA graph captures its
rebase_k128."""

import shutil

import pytest
import torch

from megamoe import reference as ref


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_activation_tables_regenerate_bit_for_bit(tmp_path):
    from megamoe.silu_probe import generate

    shipped_table = {"silu": ref.silu_table, "glu_oai": ref.glu_table}
    for kind, tables in generate(tmp_path).items():
        for fast, path in tables.items():
            fresh = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.int32)
            try:
                shipped = shipped_table[kind](fast).view(torch.int32)
            except FileNotFoundError as e:  # not shipped yet: the generated file is what to ship
                pytest.fail(f"{e}; this run made it at {path}")
            differ = (fresh != shipped).nonzero().flatten()
            assert differ.numel() == 0, (
                f"{path.name}: {differ.numel()} entries differ, first bf16 patterns {differ[:8].tolist()}; "
                "regenerate with python -m megamoe.silu_probe"
            )


def test_cuda_reference_equals_cpu_reference():
    cfg = ref.MoEConfig(
        hidden=512,
        intermediate=256,
        num_experts=8,
        top_k=4,
        num_ranks=2,
        max_tokens_per_rank=64,
        block_m=32,
        activation_clamp=3.0,
    )
    inputs = ref.make_inputs(cfg, [64, 37], seed=11, masked_ratio=0.1)
    weights = ref.random_weights(8, 512, 256, seed=11)
    cpu = ref.run_reference(cfg, inputs, weights)
    gpu = ref.run_reference(cfg, [i.to("cuda") for i in inputs], weights.to("cuda"))
    for dc, dg in zip(cpu.dumps, gpu.dumps):
        for name, t in dc.items():
            g = dg[name].cpu()
            same = torch.equal(
                t.view(torch.uint8) if t.dtype == torch.bfloat16 else t,
                g.view(torch.uint8) if g.dtype == torch.bfloat16 else g,
            )
            assert same, name


def test_rebase_k128_is_captured_by_a_cuda_graph():
    # The fast mode's operand transform runs inside graphs (megamoe.gemm's k128 entry points given
    # no x_sf128, bench.layer's unfused column): a replay must give the eager call's bits.
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (64, 512), generator=g, dtype=torch.int32).to(torch.uint8).cuda()
    sf = torch.randint(100, 160, (64, 16), generator=g, dtype=torch.int32).to(torch.uint8).cuda()
    want = ref.rebase_k128(codes, sf)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        got = ref.rebase_k128(codes, sf)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
