"""CUDA sources of the megamoe kernel (package data of `megamoe.kernel`); built by megamoe.jit."""

from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
