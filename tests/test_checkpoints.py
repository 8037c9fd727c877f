"""megamoe.checkpoints: gpt-oss MXFP4 expert checkpoints (SPEC §8) in both published namings, byte
for byte to canonical weights and back; decoded as the published loaders decode them; one-line
errors naming the tensor."""

from __future__ import annotations

import pytest
import torch

from megamoe import checkpoints as CK
from megamoe import reference as ref
from megamoe.reference import formats as F

pytest.importorskip("safetensors")

E, H, INTER = 3, 96, 64  # multiples of 32, not of 128, as gpt-oss's 2880


def _weights(seed: int) -> ref.ExpertWeights:
    w = ref.random_weights(E, H, INTER, seed=seed)
    g = torch.Generator().manual_seed(seed)
    w.b1 = torch.randn(E, 2 * INTER, generator=g).to(torch.bfloat16)
    w.b2 = torch.randn(E, H, generator=g).to(torch.bfloat16)
    return w


def _same(a: ref.ExpertWeights, b: ref.ExpertWeights) -> bool:
    return all(
        torch.equal(getattr(a, n).view(torch.uint8), getattr(b, n).view(torch.uint8))
        for n in ("w1", "w1_sf", "w2", "w2_sf", "b1", "b2")
    )


@pytest.mark.parametrize("naming", list(CK.NAMINGS))
def test_a_checkpoint_round_trips_byte_for_byte_in_either_naming(tmp_path, naming):
    layers = {0: _weights(1), 5: _weights(2)}
    CK.save_gpt_oss_experts(tmp_path / "m.safetensors", layers, naming=naming)
    for n, w in layers.items():
        assert _same(CK.load_gpt_oss_experts(tmp_path / "m.safetensors", n), w)


def test_the_loader_decodes_as_the_published_loaders_do(tmp_path):
    """The published decode (transformers' MXFP4 integration, gpt-oss's weights.py): per byte, the
    low nibble is the even element, the high nibble the odd one, through the E2M1 table, times
    2^(scale - 127); gate_up rows alternate gate, up. Built here from raw checkpoint bytes."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (E, 2 * INTER, H // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(110, 135, (E, 2 * INTER, H // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    names = {k: v.format(n=0) for k, v in CK.NAMINGS["original"].items()}
    save_file(
        {
            names["w1"]: blocks,
            names["w1_sf"]: scales,
            names["b1"]: torch.zeros(E, 2 * INTER, dtype=torch.bfloat16),
            names["w2"]: torch.zeros(E, H, INTER // 32, 16, dtype=torch.uint8),
            names["w2_sf"]: torch.full((E, H, INTER // 32), 127, dtype=torch.uint8),
            names["b2"]: torch.zeros(E, H, dtype=torch.bfloat16),
        },
        str(tmp_path / "raw.safetensors"),
    )
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    vals = torch.empty(E, 2 * INTER, H // 32, 32)
    vals[..., 0::2] = lut[(blocks & 0x0F).long()]
    vals[..., 1::2] = lut[(blocks >> 4).long()]
    published = torch.ldexp(vals, scales.to(torch.int32)[..., None] - 127).reshape(E, 2 * INTER, H)
    gate, up = published[:, 0::2], published[:, 1::2]
    w = CK.load_gpt_oss_experts(tmp_path / "raw.safetensors", 0)
    ours = ref.dequantize_fp4(w.w1, w.w1_sf).to(torch.float32)
    assert torch.equal(ours[:, :INTER], gate) and torch.equal(ours[:, INTER:], up)
    assert torch.equal(F.unpack_fp4(w.w1[:, :INTER]), F.unpack_fp4(blocks[:, 0::2].reshape(E, INTER, H // 2)))


def test_a_folder_of_shards_is_one_checkpoint(tmp_path):
    CK.save_gpt_oss_experts(tmp_path / "model-00001-of-00002.safetensors", {0: _weights(4)})
    CK.save_gpt_oss_experts(tmp_path / "model-00002-of-00002.safetensors", {1: _weights(5)})
    assert _same(CK.load_gpt_oss_experts(tmp_path, 1), _weights(5))
    assert _same(CK.load_gpt_oss_experts(tmp_path, 0), _weights(4))


def _written_without(tmp_path, drop: str, replace: dict | None = None, name: str = "bad"):
    from safetensors.torch import load_file, save_file

    CK.save_gpt_oss_experts(tmp_path / "full.safetensors", {2: _weights(6)})
    tensors = load_file(str(tmp_path / "full.safetensors"))
    tensors = {k: v for k, v in tensors.items() if not k.endswith(drop) or not drop}
    tensors.update(replace or {})
    save_file(tensors, str(tmp_path / f"{name}.safetensors"))
    return tmp_path / f"{name}.safetensors"


def test_bad_checkpoints_are_one_line_errors_naming_the_tensor(tmp_path):
    name = "model.layers.2.mlp.experts.down_proj_bias"
    cases = [
        (_written_without(tmp_path, "down_proj_bias"), 2, f"tensor {name} is missing"),
        (
            _written_without(tmp_path, "", {name: torch.zeros(E, H, dtype=torch.float32)}, "dtype"),
            2,
            f"tensor {name}: expected torch.bfloat16, got torch.float32",
        ),
        (
            _written_without(tmp_path, "", {name: torch.zeros(E, H + 1, dtype=torch.bfloat16)}, "shape"),
            2,
            f"tensor {name}: expected shape [{E}, {H}], got [{E}, {H + 1}]",
        ),
        (tmp_path / "full.safetensors", 7, "no experts of layer 7 in either naming (layers 2..2)"),
        (tmp_path / "nothing-here", 0, "no such file or folder"),
    ]
    for path, layer, words in cases:
        with pytest.raises(CK.CheckpointError) as e:
            CK.load_gpt_oss_experts(path, layer)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
