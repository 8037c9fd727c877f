"""megamoe.kernel — the CUDA sources (package data); see kernel/README.md for the layout."""
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
