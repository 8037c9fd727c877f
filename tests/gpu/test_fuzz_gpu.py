"""Six fuzz cases on the fused kernel, R = 1, 2 and 4 (megamoe/fuzz.py). The full run is
`python -m megamoe.fuzz --device cuda --cases 300 --jobs 8`; bench/NOTES.md has its counts."""

from __future__ import annotations

from megamoe import fuzz


def test_six_fuzz_cases_conform_on_the_kernel(capsys):
    code = fuzz.main(["--device", "cuda", "--seed", "1", "--cases", "6"])
    captured = capsys.readouterr()
    assert code == 0, captured.err + captured.out
