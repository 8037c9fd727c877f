"""Dump files: one object per rank holding every dump point D1-D10 as named tensors in canonical
layouts, the inputs needed to recompute each expectation, and metadata (SPEC §5).

Tensor names:
    D1.* ... D10.*      the dump points: every name, dtype and shape is in the dump-point table,
                        megamoe.reference.points (P.check_dump_tensors checks a dict against it)
    inputs.*            this rank's x (uint8 E4M3 codes), x_sf, topk_idx, topk_weights,
                        recv_stats_before
    weights.*           this rank's local expert weights, canonical (w1, w1_sf, w2, w2_sf, and b1, b2
                        where the layer has SPEC §8's biases)
Metadata (`make_dumps` assembles it, the one place): config (MoEConfig fields), rank, world_size,
kernel_mode, build_id, tau (the declared GEMM_BOUND τ per GEMM point), grid_snapped (inputs chosen
for GEMM_EXACT), recv_stats_recorded (whether the call added its receive counts to D10's
statistics), call_id (one id shared by every rank's dump of one call, so that the suite refuses
rank files of different calls instead of reporting their mismatch as a kernel failure; files
written before it have none, which counts as unknown), and "weights" below.

The weights are most of a file's bytes (every checker needs them, so every rank carries its own).
A file may leave them out (`Dump.without_weights`, `megamoe dump --no-weights`); its meta then
holds "weights": the SHA-256 of the rank's local weights and, where they came from
`random_weights`, its seed. Before such dumps are checked the weights are put back from a set
given separately, or regenerated from the seed, and each rank's SHA-256 must match
(`with_weights`), so a dump is never checked against weights it was not made with.

A dump may also be cut to some tokens (`sample_tokens`), for calls too large to keep whole (a CI
fixture at gpt-oss's 2880): two masks, sample.rows (bool [P]) and sample.tokens (bool [T]), say which
pool rows (those that hold a kept token's slots) and which tokens it holds, and the checkers
compare those only (`Dump.rows_checked`, `Dump.tokens_checked`). The row-sized tensors (SAMPLED_ROWS,
SAMPLED_TOKENS) are written for the kept rows only and read back in full shape, zero elsewhere;
everything else (routing, counts, source lists, pool metadata and weights, counters) is whole.

A file is `torch.save` of {"format": "megamoe-dump", "version": 1, "meta": ..., "tensors": ...},
read back with `weights_only=True` (no code is unpickled).

The format sits between the reference and its two users, the checkers and the runtime (megamoe.moe
makes a kernel call's dumps here): it imports nothing of megamoe but the reference, so the library
never imports the checkers (tests/test_package_hygiene.py keeps that).
"""

from __future__ import annotations

import hashlib
import math
import pickle
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from megamoe import reference as ref
from megamoe.reference import points as P

FORMAT = "megamoe-dump"
VERSION = 1
REFERENCE_TAU = 2.0**-24  # the reference rounds an exact sum once to fp32


class DumpFormatError(ValueError):
    """A file that is not a megamoe dump, or one of another format version."""


@dataclass
class Dump:
    tensors: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)
    source: str | None = field(default=None, compare=False, repr=False)  # the file it was loaded from

    @property
    def call_id(self) -> str | None:
        """The id of the call this dump is of; None (unknown) in files written before there was one."""
        return self.meta.get("call_id")

    @property
    def name(self) -> str:
        """How a message names this dump: its file, else its rank."""
        return self.source if self.source is not None else f"the dump of rank {self.rank}"

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])

    @property
    def world_size(self) -> int:
        return int(self.meta["world_size"])

    @property
    def config(self) -> ref.MoEConfig:
        return ref.MoEConfig(**self.meta["config"])

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def inputs(self) -> ref.RankInputs:
        t = self.tensors
        return ref.RankInputs(
            ref.as_float8(t["inputs.x"]), t["inputs.x_sf"], t["inputs.topk_idx"], t["inputs.topk_weights"]
        )

    @property
    def sampled(self) -> bool:
        """Whether this dump holds some tokens only (`sample_tokens`)."""
        return SAMPLE_ROWS in self.tensors

    def rows_checked(self) -> torch.Tensor:
        """bool [P]: the valid pool rows (SPEC §3's layout), of a sampled dump those it holds."""
        valid = ref.valid_rows(self.tensors)
        return valid & self.tensors[SAMPLE_ROWS].to(valid.device) if self.sampled else valid

    def tokens_checked(self) -> torch.Tensor:
        """bool [T]: this rank's tokens, of a sampled dump those it holds."""
        if self.sampled:
            return self.tensors[SAMPLE_TOKENS]
        return torch.ones(self.tensors["inputs.topk_idx"].shape[0], dtype=torch.bool)

    def weights(self) -> ref.ExpertWeights:
        t = self.tensors
        biases = {n: t.get(f"weights.{n}") for n in BIAS_NAMES}  # SPEC §8's, where the layer has them
        return ref.ExpertWeights(t["weights.w1"], t["weights.w1_sf"], t["weights.w2"], t["weights.w2_sf"], **biases)

    @property
    def has_weights(self) -> bool:
        return all(f"weights.{n}" in self.tensors for n in WEIGHT_NAMES)

    def without_weights(self, seed: int | None = None, biases_seed: int | None = None) -> "Dump":
        """This dump without its weights, which it names by their SHA-256, and by the seeds of
        `random_weights` and `random_biases` that made them, when there are such (weights with
        biases name both seeds, or neither)."""
        has_biases = any(f"weights.{n}" in self.tensors for n in BIAS_NAMES)
        if biases_seed is not None and (seed is None or not has_biases):
            why = "no random_weights seed" if seed is None else "a layer without biases"
            ref.errors.fail("biases_seed", f"None for {why}", biases_seed)
        if seed is not None and has_biases and biases_seed is None:
            ref.errors.fail("biases_seed", "the seed of random_biases too", biases_seed)
        tensors = {k: v for k, v in self.tensors.items() if not k.startswith("weights.")}
        named = {"sha256": weights_digest(self.weights()), "random_weights_seed": seed}
        if biases_seed is not None:
            named["random_biases_seed"] = biases_seed
        return Dump(tensors, dict(self.meta, weights=named), self.source)

    def copy(self) -> "Dump":
        return Dump({k: v.clone() for k, v in self.tensors.items()}, dict(self.meta), self.source)

    def save(self, path: str | Path) -> None:
        tensors = {k: v.detach().cpu() for k, v in self.tensors.items()}
        if self.sampled:  # the kept rows only (load puts them back in place)
            tensors.update(_cut(tensors))
        torch.save(
            {
                "format": FORMAT,
                "version": VERSION,
                "meta": self.meta,
                "tensors": {k: v.contiguous() for k, v in tensors.items()},
            },
            path,
        )

    @classmethod
    def load(cls, path: str | Path) -> "Dump":
        """Read a dump file; anything else raises DumpFormatError with one line saying what it is."""
        path = Path(path)
        if not path.exists():
            raise DumpFormatError(f"{path}: no such file")
        if path.is_dir():
            raise DumpFormatError(f"{path}: is a folder, not a dump file")
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; torch.load's errors on
            # other files are misleading (a text file gives "KeyError: 101")
            raise DumpFormatError(f"{path}: not a megamoe dump: {_what_it_is(path)}, not a torch.save zip archive")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            # torch's own message suggests weights_only=False, which would run code from the file
            raise DumpFormatError(
                f"{path}: not a megamoe dump: it holds Python objects other than tensors, "
                "and megamoe never unpickles those"
            ) from None
        except Exception as exc:  # a zip archive torch cannot read
            raise DumpFormatError(
                f"{path}: not a megamoe dump: a zip archive that torch.load cannot read ({type(exc).__name__})"
            ) from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise DumpFormatError(f"{path}: not a megamoe dump: a torch file without the '{FORMAT}' header")
        if obj.get("version") != VERSION:
            raise DumpFormatError(
                f"{path}: dump format version {obj.get('version')}; this megamoe reads "
                f"version {VERSION}. Record the dump again with this version."
            )
        required = REQUIRED if "weights" not in obj["meta"] else [k for k in REQUIRED if not k.startswith("weights.")]
        missing = [k for k in required if k not in obj["tensors"]]
        if missing:
            raise DumpFormatError(f"{path}: dump lacks {', '.join(missing)}")
        tensors = obj["tensors"]
        if SAMPLE_ROWS in tensors:
            try:
                tensors.update(_uncut(tensors, ref.MoEConfig(**obj["meta"]["config"])))
            except (KeyError, RuntimeError, IndexError, TypeError) as exc:
                raise DumpFormatError(f"{path}: a sampled dump whose kept rows do not fit its masks ({exc})") from None
        return cls(tensors, obj["meta"], str(path))


def _what_it_is(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4096)
    if not head:
        return "an empty file"
    return "binary data" if b"\x00" in head else "a text file"  # text has no NUL bytes


def global_weights(dumps: list[Dump]) -> ref.ExpertWeights:
    """All E experts' weights, from the local weights in the dumps of every rank (rank order)."""
    ordered = sorted(dumps, key=lambda d: d.rank)
    biases = {
        n: torch.cat([d[f"weights.{n}"] for d in ordered])
        for n in BIAS_NAMES
        if all(f"weights.{n}" in d.tensors for d in ordered)
    }
    return ref.ExpertWeights(*(torch.cat([d[f"weights.{n}"] for d in ordered]) for n in WEIGHT_NAMES), **biases)


# A sampled dump (sample_tokens): its masks, and the tensors written for the kept rows only.
SAMPLE_ROWS, SAMPLE_TOKENS = "sample.rows", "sample.tokens"
SAMPLED_ROWS = (P.D4_POOL_X, P.D4_POOL_X_SF, P.D5_ACC1, P.D6_L2_ACTS, P.D6_L2_SF, P.D7_ACC2)  # [P, ...]
SAMPLED_TOKENS = ("inputs.x", P.D9_Y)  # [T, ...]; and D8.combine [K, T_max, H] along its tokens


def _cut(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    rows, tokens = t[SAMPLE_ROWS], t[SAMPLE_TOKENS]
    out = {n: t[n][rows] for n in SAMPLED_ROWS}
    out.update({n: t[n][tokens] for n in SAMPLED_TOKENS})
    out[P.D8_COMBINE] = t[P.D8_COMBINE][:, : tokens.numel()][:, tokens]
    return out


def _uncut(t: dict[str, torch.Tensor], cfg: ref.MoEConfig) -> dict[str, torch.Tensor]:
    """The full-shape tensors of a sampled dump's kept rows, zero elsewhere."""
    rows, tokens = t[SAMPLE_ROWS], t[SAMPLE_TOKENS]

    def place(cut: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        full = torch.zeros((mask.numel(), *cut.shape[1:]), dtype=cut.dtype)
        full[mask] = cut
        return full

    out = {n: place(t[n], rows) for n in SAMPLED_ROWS}
    out.update({n: place(t[n], tokens) for n in SAMPLED_TOKENS})
    cut = t[P.D8_COMBINE]
    combine = torch.zeros((cut.shape[0], cfg.max_tokens_per_rank, cut.shape[2]), dtype=cut.dtype)
    combine[:, : tokens.numel()][:, tokens] = cut
    out[P.D8_COMBINE] = combine
    return out


def sample_tokens(dumps: list[Dump], tokens: list[list[int]]) -> list[Dump]:
    """The dumps of one call (rank order) cut to `tokens[r]` of each rank r: of its own tensors the
    kept tokens' x, combine rows and y, and on every rank the pool rows that hold a kept token's
    slots; the rest of those tensors is zeroed (and not written by `save`)."""
    if len(tokens) != len(dumps):
        ref.errors.fail("tokens", f"one list of token indices per rank ({len(dumps)})", f"{len(tokens)} lists")
    if [d.rank for d in dumps] != list(range(len(dumps))):
        ref.errors.fail("dumps", "every rank's dump of one call, in rank order", [d.rank for d in dumps])
    keep = []
    for d, ts in zip(dumps, tokens):
        n = d["inputs.topk_idx"].shape[0]
        if any(not 0 <= int(t) < n for t in ts):
            ref.errors.fail("tokens", f"rank {d.rank}'s token indices in [0, {n})", list(ts))
        mask = torch.zeros(n, dtype=torch.bool)
        mask[torch.as_tensor(list(ts), dtype=torch.long)] = True
        keep.append(mask)
    out = []
    for d in dumps:
        meta = d[P.D4_POOL_META].long().cpu()
        rows = torch.zeros(meta.shape[0], dtype=torch.bool)
        for s, mask in enumerate(keep):
            mine = (meta[:, 0] == s) & (meta[:, 1] >= 0) & (meta[:, 1] < mask.numel())
            rows[mine] = mask[meta[mine, 1]]
        t = {k: v.detach().cpu().clone() for k, v in d.tensors.items()}  # its own: the call's dumps stay
        t[SAMPLE_ROWS], t[SAMPLE_TOKENS] = rows, keep[d.rank]
        # What is not kept, zeroed: the sampled dump holds what its file will (save cuts, load puts back).
        t.update(_uncut({**t, **_cut(t)}, d.config))
        out.append(Dump(t, dict(d.meta), d.source))
    return out


WEIGHT_NAMES = ("w1", "w1_sf", "w2", "w2_sf")
BIAS_NAMES = ("b1", "b2")  # optional (SPEC §8): a dump of a layer with biases carries them too


def weights_digest(w: ref.ExpertWeights) -> str:
    """SHA-256 of canonical weights: every tensor's dtype, shape and bytes, in SPEC order."""
    h = hashlib.sha256()
    # The biases only where present: the digest of weights without them is what it always was.
    for name in WEIGHT_NAMES + tuple(n for n in BIAS_NAMES if getattr(w, n) is not None):
        t = getattr(w, name).detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {list(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def with_weights(
    dumps: list[Dump], weights: ref.ExpertWeights | None = None, progress: Callable[[str], None] | None = None
) -> list[Dump]:
    """The dumps of one call (rank order), each with its local weights: the dumps' own, else the
    global `weights` given, else `random_weights` regenerated from the seed in the dumps. Weights
    put back must match each rank's recorded SHA-256 (DumpFormatError otherwise). `progress` gets a
    line per step, because at real sizes regenerating and hashing the weights takes minutes."""
    if all(d.has_weights for d in dumps):
        return dumps
    say = progress or (lambda _: None)
    cfg = dumps[0].config
    if weights is None:
        seeds = {(d.meta.get("weights") or {}).get("random_weights_seed") for d in dumps if not d.has_weights}
        if len(seeds) != 1 or None in seeds:
            raise DumpFormatError(
                "the dumps hold no weights and name no random_weights seed: pass the weights they were made with"
            )
        seed = seeds.pop()
        say(
            f"the dumps hold no weights: regenerating those of {cfg.num_experts} experts "
            f"(H={cfg.hidden} I={cfg.intermediate}) from random_weights seed {seed}"
        )
        t0 = time.perf_counter()
        weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=seed)
        biases = {(d.meta.get("weights") or {}).get("random_biases_seed") for d in dumps if not d.has_weights}
        if len(biases) != 1:
            raise DumpFormatError(
                f"the dumps of one call name different random_biases seeds: {sorted(map(str, biases))}"
            )
        if biases != {None}:
            weights.b1, weights.b2 = ref.random_biases(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=biases.pop())
        say(f"weights regenerated in {time.perf_counter() - t0:.1f} s")
    e_l = cfg.local_experts
    out = []
    for d in dumps:
        if d.has_weights:
            out.append(d)
            continue
        local = weights.slice(d.rank * e_l, (d.rank + 1) * e_l)
        say(f"rank {d.rank}: comparing its weights with the SHA-256 its dump names")
        digest = weights_digest(local)
        if digest != d.meta["weights"]["sha256"]:
            raise DumpFormatError(
                f"rank {d.rank}: the weights given are not the ones this dump was made with "
                f"(SHA-256 {digest[:12]}..., the dump names {d.meta['weights']['sha256'][:12]}...)"
            )
        names = WEIGHT_NAMES + tuple(n for n in BIAS_NAMES if getattr(local, n) is not None)
        out.append(Dump(dict(d.tensors, **{f"weights.{n}": getattr(local, n) for n in names}), d.meta, d.source))
    return out


def call_dump_bytes(cfg: ref.MoEConfig, routed: float = 1.0) -> int:
    """About the bytes of every rank's dump of one call of T_max tokens per rank, inputs and weights
    included, by the dump-point table: the least that making those dumps holds in memory at once.
    `routed`: the fraction of the slots routed to an expert (not -1), each one pool row of one rank
    (the padding rows that align the experts are left out)."""
    ranks, t, k, h, i = cfg.num_ranks, cfg.max_tokens_per_rank, cfg.top_k, cfg.hidden, cfg.intermediate
    dims = P.dump_dims(cfg, tokens=t, pool_rows=int(t * k * routed), counter_words=0)
    points = sum(math.prod(d.shape_of(dims)) * d.dtype.itemsize for d in P.TABLE.values())
    inputs = t * (h + h // 32 + k * 8 + k * 4) + cfg.local_experts * 8
    weights = cfg.local_experts * (2 * i * (h // 2 + h // 32) + h * (i // 2 + i // 32))
    return ranks * (points + inputs + weights)


def new_call_id() -> str:
    """A fresh id for one call, recorded in every rank's dump of it. Random rather than derived
    from the call's contents: each rank knows only its own inputs, and a kernel's ranks agree on
    rank 0's id (megamoe.ranks.from_rank0)."""
    return uuid.uuid4().hex


def one_call(dumps: list[Dump]) -> None:
    """Raise ValueError, naming the files, unless the dumps' call ids agree (an unknown id, of a file
    written before dumps had one, agrees with any)."""
    known = {d.call_id for d in dumps if d.call_id is not None}
    if len(known) > 1:
        names = ", ".join(f"{d.name} (call {d.call_id[:8] if d.call_id else 'unknown'})" for d in dumps)
        raise ValueError(f"check needs the dumps of one call; these are from different calls: {names}")


REQUIRED = (
    "inputs.x",
    "inputs.x_sf",
    "inputs.topk_idx",
    "inputs.topk_weights",
    "inputs.recv_stats_before",
    "weights.w1",
    "weights.w1_sf",
    "weights.w2",
    "weights.w2_sf",
)


def make_dumps(
    cfg: ref.MoEConfig,
    inputs: list[ref.RankInputs],
    weights: ref.ExpertWeights,
    points: list[dict[str, torch.Tensor]],
    *,
    kernel_mode: str,
    build_id: str,
    tau: dict[str, float],
    grid_snapped: bool = False,
    recv_stats_before: list[torch.Tensor] | None = None,
    recv_stats_recorded: bool = True,
    ranks: list[int] | None = None,
    call_id: str | None = None,
) -> list[Dump]:
    """Wrap per-rank dump points (from the reference or a kernel) into Dump objects. ranks: the rank
    of each entry (default 0, 1, ...: every rank of the call); `weights` are all E experts, or the
    local experts of the listed ranks in that order (a kernel rank passes its own). call_id: the
    call's id (`new_call_id`), which every rank's dump of the call must carry; by default a new one,
    shared by the dumps made here (a rank that makes only its own passes the one its ranks agreed on)."""
    e_l = cfg.local_experts
    call_id = new_call_id() if call_id is None else call_id
    ranks = list(range(len(inputs))) if ranks is None else list(ranks)
    local_only = weights.w1.shape[0] != cfg.num_experts
    dumps = []
    for i, (rank, inp, pts) in enumerate(zip(ranks, inputs, points)):
        first = (i if local_only else rank) * e_l
        local = weights.slice(first, first + e_l)
        before = (
            torch.zeros(e_l, dtype=torch.int64) if recv_stats_before is None else recv_stats_before[i].to(torch.int64)
        )
        tensors = {
            **{k: v.detach().cpu() for k, v in pts.items()},
            "inputs.x": ref.as_codes(inp.x).cpu(),
            "inputs.x_sf": inp.x_sf.cpu(),
            "inputs.topk_idx": inp.topk_idx.cpu(),
            "inputs.topk_weights": inp.topk_weights.cpu(),
            "inputs.recv_stats_before": before.cpu(),
            "weights.w1": local.w1.cpu(),
            "weights.w1_sf": local.w1_sf.cpu(),
            "weights.w2": local.w2.cpu(),
            "weights.w2_sf": local.w2_sf.cpu(),
            **{f"weights.{n}": getattr(local, n).cpu() for n in BIAS_NAMES if getattr(local, n) is not None},
        }
        meta = {
            "config": cfg.to_dict(),
            "rank": rank,
            "world_size": cfg.num_ranks,
            "kernel_mode": kernel_mode,
            "build_id": build_id,
            "tau": dict(tau),
            "grid_snapped": grid_snapped,
            "recv_stats_recorded": bool(recv_stats_recorded),
            "call_id": call_id,
        }
        dumps.append(Dump(tensors, meta))
    return dumps


def reference_dumps(
    cfg: ref.MoEConfig,
    inputs: list[ref.RankInputs],
    weights: ref.ExpertWeights,
    *,
    tamper=None,
    grid_snapped: bool = False,
    recv_stats_before: list[torch.Tensor] | None = None,
) -> list[Dump]:
    """The "expected" dumps: the reference run in exactly the kernel's dump format (a `tamper`
    hook plants faults for the catalog)."""
    result = ref.run_reference(cfg, inputs, weights, recv_stats=recv_stats_before, tamper=tamper)
    return make_dumps(
        cfg,
        inputs,
        weights,
        result.dumps,
        kernel_mode="reference",
        build_id="reference",
        tau={P.D5: REFERENCE_TAU, P.D7: REFERENCE_TAU},
        grid_snapped=grid_snapped,
        recv_stats_before=recv_stats_before,
    )
