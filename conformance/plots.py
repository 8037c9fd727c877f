"""PNG plots of the error distributions: the GEMM stages (|err| / (τ Σ|ab|), the GEMM_BOUND
statistic, where 1 is the bound) and the end-to-end output (y against the float64 oracle, in bf16
ulps). Needs matplotlib: `pip install megamoe[plots]`."""

from __future__ import annotations

from pathlib import Path

import torch

from megamoe import reference as ref
from megamoe.reference import points as P

from .dump import Dump, global_weights
from .gemm import GEMMS, error_ratios


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install 'megamoe[plots]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_hist(ax, values: torch.Tensor, label: str) -> None:
    v = values.flatten().to(torch.float64)
    zeros = int((v == 0).sum())
    nz = v[v > 0]
    if nz.numel():
        ax.hist(torch.log10(nz).numpy(), bins=60, histtype="step", label=f"{label} ({zeros} exact)")
    else:
        ax.plot([], [], label=f"{label} (all {zeros} exact)")


def _finish(plt, fig, ax, path: Path, title: str, xlabel: str) -> Path:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("elements")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gemm_plot(dumps: list[Dump], point: str, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for d in dumps:
        _log_hist(ax, error_ratios(d, point), f"rank {d.rank}")
    ax.axvline(0.0, color="red", linestyle="--", label="bound (ratio 1)")
    meta = dumps[0].meta
    return _finish(
        plt,
        fig,
        ax,
        path,
        f"{GEMMS[point][0]}: |acc - exact| / (tau sum|ab|), tau = {meta['tau'][point]:.3g}, mode {meta['kernel_mode']}",
        "log10 ratio to the GEMM_BOUND bound",
    )


def end_to_end_plot(dumps: list[Dump], path: Path) -> Path:
    plt = _pyplot()
    cfg = dumps[0].config
    oracle = ref.run_oracle(cfg, [d.inputs() for d in dumps], global_weights(dumps))
    fig, ax = plt.subplots(figsize=(7, 4))
    for d, orc in zip(dumps, oracle):
        y = d[P.D9_Y].to(torch.float64)
        _, e = torch.frexp(orc.y)
        ulp = torch.exp2(torch.clamp(e.to(torch.float64) - 1, min=-126) - 7)
        err = ((y - orc.y).abs() / ulp)[torch.isfinite(y) & torch.isfinite(orc.y)]
        _log_hist(ax, err, f"rank {d.rank}, calc_diff {ref.calc_diff(y, orc.y):.2e}")
    return _finish(plt, fig, ax, path, "y against the float64 oracle (end to end)", "log10 |error| in bf16 ulps")


def write_plots(dumps: list[Dump], out_dir: str | Path) -> list[Path]:
    """The three plots of a run: D5, D7 and end-to-end, as PNG files in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        gemm_plot(dumps, P.D5, out / "d5_acc1_error.png"),
        gemm_plot(dumps, P.D7, out / "d7_acc2_error.png"),
        end_to_end_plot(dumps, out / "y_end_to_end_error.png"),
    ]
