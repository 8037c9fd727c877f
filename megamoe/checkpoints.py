"""gpt-oss expert weights from MXFP4 safetensors checkpoints (SPEC §8), as canonical `ExpertWeights`.

    w = load_gpt_oss_experts("gpt-oss-20b/", layer=3)            # w1, w1_sf, w2, w2_sf, b1, b2
    save_gpt_oss_experts("tiny.safetensors", {0: w}, naming="original")   # the inverse (tests, examples)

A checkpoint is one .safetensors file or a folder of them (the published repositories shard the
model over several files). Tensors are read through safetensors' memory map, one at a time; only
the layer's six expert tensors are read. Both namings of the published repositories:

    transformers  model.layers.{n}.mlp.experts.{gate_up_proj,down_proj}_{blocks,scales,bias}
    original      block.{n}.mlp.{mlp1,mlp2}_weight.{blocks,scales}, block.{n}.mlp.{mlp1,mlp2}_bias

What the tensors hold (checked against the published loaders: transformers' MXFP4 integration and
the gpt-oss repository's weights.py, which decode `blocks` nibble by nibble, the low nibble as the
even element, and scale by 2^(byte - 127)):

    *_blocks  uint8 [E, N, K/32, 16]  32 E2M1 codes per 16 bytes, element 2i in the low nibble
                                      (SPEC §1's packing: canonical [E, N, K/2] is a reshape)
    *_scales  uint8 [E, N, K/32]      UE8M0 (SPEC §1)
    *_bias    bf16  [E, N]
    gate_up / mlp1: N = 2I, rows alternating: row 2j is gate channel j, row 2j + 1 up channel j
                    (canonical: gate rows [0, I), then up rows [I, 2I); the loader de-interleaves)
    down / mlp2:    N = H, K = I

A missing tensor, a wrong dtype or shape, or a layer the checkpoint does not have is one line
(CheckpointError) naming the tensor and the file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megamoe import reference as ref

NAMINGS = {
    "transformers": {
        "w1": "model.layers.{n}.mlp.experts.gate_up_proj_blocks",
        "w1_sf": "model.layers.{n}.mlp.experts.gate_up_proj_scales",
        "b1": "model.layers.{n}.mlp.experts.gate_up_proj_bias",
        "w2": "model.layers.{n}.mlp.experts.down_proj_blocks",
        "w2_sf": "model.layers.{n}.mlp.experts.down_proj_scales",
        "b2": "model.layers.{n}.mlp.experts.down_proj_bias",
    },
    "original": {
        "w1": "block.{n}.mlp.mlp1_weight.blocks",
        "w1_sf": "block.{n}.mlp.mlp1_weight.scales",
        "b1": "block.{n}.mlp.mlp1_bias",
        "w2": "block.{n}.mlp.mlp2_weight.blocks",
        "w2_sf": "block.{n}.mlp.mlp2_weight.scales",
        "b2": "block.{n}.mlp.mlp2_bias",
    },
}


class CheckpointError(ValueError):
    """A checkpoint that is not a gpt-oss MXFP4 expert checkpoint as documented (one line)."""


def _safetensors():
    try:
        import safetensors.torch  # noqa: F401 (the package, a real dependency: pip install megamoe[checkpoints])
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise CheckpointError(
            "megamoe.checkpoints needs the safetensors package: pip install 'megamoe[checkpoints]'"
        ) from e
    return safe_open


def _files(path: str | Path) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if files:
            return files
        raise CheckpointError(f"checkpoint {p}: no .safetensors file in this folder")
    raise CheckpointError(f"checkpoint {p}: no such file or folder")


def _index(files: list[Path]) -> dict[str, Path]:
    """Tensor name -> the file that holds it (reads the files' headers only)."""
    safe_open = _safetensors()
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                where[name] = f
    return where


def _naming(where: dict[str, Path], layer: int, path) -> str:
    for naming, names in NAMINGS.items():
        if names["w1"].format(n=layer) in where:
            return naming
    layers = sorted(
        {
            int(k.split(".")[i])
            for k in where
            for prefix, i in (("model.layers.", 2), ("block.", 1))
            if k.startswith(prefix) and k.split(".")[i].isdigit()
        }
    )
    have = f"layers {layers[0]}..{layers[-1]}" if layers else "no gpt-oss expert tensors"
    raise CheckpointError(f"checkpoint {path}: no experts of layer {layer} in either naming ({have})")


def _read(where: dict[str, Path], name: str, dtype: torch.dtype, shape: tuple, device) -> torch.Tensor:
    """One tensor, checked: dtype and shape (None: any size there)."""
    if name not in where:
        raise CheckpointError(f"checkpoint: tensor {name} is missing")
    safe_open = _safetensors()
    with safe_open(str(where[name]), framework="pt", device="cpu") as h:
        t = h.get_tensor(name)
    if t.dtype != dtype:
        raise CheckpointError(f"checkpoint {where[name].name}: tensor {name}: expected {dtype}, got {t.dtype}")
    if len(t.shape) != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise CheckpointError(
            f"checkpoint {where[name].name}: tensor {name}: expected shape {want}, got {list(t.shape)}"
        )
    return t.to(device)


def _gate_up_canonical(t: torch.Tensor) -> torch.Tensor:
    """Rows alternating gate/up (row 2j gate j, 2j + 1 up j) -> gate rows, then up rows."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()


def _gate_up_alternating(t: torch.Tensor) -> torch.Tensor:
    i = t.shape[1] // 2
    out = torch.empty_like(t)
    out[:, 0::2], out[:, 1::2] = t[:, :i], t[:, i:]
    return out


def gpt_oss_layer_shape(path: str | Path, layer: int) -> tuple[int, int, int]:
    """(E, H, I) of MoE layer `layer` of a gpt-oss checkpoint, from its files' headers (no tensor is
    read): what a layer's MoEConfig needs before its weights are loaded."""
    ref.errors.check_int("layer", layer, 0)
    where = _index(_files(path))
    name = NAMINGS[_naming(where, layer, path)]["w1"].format(n=layer)
    with _safetensors()(str(where[name]), framework="pt") as h:
        shape = h.get_slice(name).get_shape()
    if len(shape) != 4 or shape[3] != 16 or shape[1] % 2:
        raise CheckpointError(f"checkpoint: tensor {name}: expected shape [E, 2I, H/32, 16], got {list(shape)}")
    return shape[0], 32 * shape[2], shape[1] // 2


def load_gpt_oss_experts(path: str | Path, layer: int, *, device="cpu") -> ref.ExpertWeights:
    """The expert weights of MoE layer `layer` of a gpt-oss checkpoint (a .safetensors file or a
    folder of them), canonical (SPEC §2) with their biases, on `device`."""
    ref.errors.check_int("layer", layer, 0)
    where = _index(_files(path))
    names = {k: v.format(n=layer) for k, v in NAMINGS[_naming(where, layer, path)].items()}
    blocks1 = _read(where, names["w1"], torch.uint8, (None, None, None, 16), device)
    e, two_i, h_groups, _ = blocks1.shape
    if two_i % 2:
        raise CheckpointError(f"checkpoint: tensor {names['w1']}: expected an even number of rows (gate and up)")
    hidden, inter = 32 * h_groups, two_i // 2
    sf1 = _read(where, names["w1_sf"], torch.uint8, (e, two_i, h_groups), device)
    b1 = _read(where, names["b1"], torch.bfloat16, (e, two_i), device)
    blocks2 = _read(where, names["w2"], torch.uint8, (e, hidden, inter // 32, 16), device)
    sf2 = _read(where, names["w2_sf"], torch.uint8, (e, hidden, inter // 32), device)
    b2 = _read(where, names["b2"], torch.bfloat16, (e, hidden), device)
    return ref.ExpertWeights(
        w1=_gate_up_canonical(blocks1.reshape(e, two_i, hidden // 2)),
        w1_sf=_gate_up_canonical(sf1),
        w2=blocks2.reshape(e, hidden, inter // 2).contiguous(),
        w2_sf=sf2.contiguous(),
        b1=_gate_up_canonical(b1),
        b2=b2.contiguous(),
    )


def save_gpt_oss_experts(
    path: str | Path, layers: dict[int, ref.ExpertWeights], *, naming: str = "transformers"
) -> None:
    """The inverse of load_gpt_oss_experts: write the layers' canonical weights (biases zero where
    absent) as one .safetensors file in `naming`."""
    if naming not in NAMINGS:
        ref.errors.fail("naming", f"one of {tuple(NAMINGS)}", repr(naming))
    _safetensors()
    from safetensors.torch import save_file

    tensors = {}
    for n, w in layers.items():
        e, two_i, h2 = w.w1.shape
        hidden, inter = 2 * h2, two_i // 2
        b1 = w.b1 if w.b1 is not None else torch.zeros(e, two_i, dtype=torch.bfloat16)
        b2 = w.b2 if w.b2 is not None else torch.zeros(e, hidden, dtype=torch.bfloat16)
        names = {k: v.format(n=n) for k, v in NAMINGS[naming].items()}
        tensors[names["w1"]] = _gate_up_alternating(w.w1.cpu()).reshape(e, two_i, hidden // 32, 16)
        tensors[names["w1_sf"]] = _gate_up_alternating(w.w1_sf.cpu())
        tensors[names["b1"]] = _gate_up_alternating(b1.cpu())
        tensors[names["w2"]] = w.w2.cpu().reshape(e, hidden, inter // 32, 16).contiguous()
        tensors[names["w2_sf"]] = w.w2_sf.cpu().contiguous()
        tensors[names["b2"]] = b2.cpu().contiguous()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
