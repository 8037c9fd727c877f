"""Ten fuzz cases on the fused kernel (megamoe/fuzz.py). The full run is
`python -m megamoe.fuzz --device cuda --cases 300 --jobs 8`; bench/NOTES.md has its counts."""

from __future__ import annotations

from megamoe import fuzz


def test_ten_fuzz_cases_conform_on_the_kernel(capsys):
    code = fuzz.main(["--device", "cuda", "--seed", "1", "--cases", "10"])
    captured = capsys.readouterr()
    assert code == 0, captured.err + captured.out
