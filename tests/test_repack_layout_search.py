"""`benchmarks/repack_layout_search.py`'s claims, checked: the layout it calls shipped is the one
`repack_codes` writes, it costs the bf16 decode 14 instructions per word, and the cheapest placement
(the variant timed and not kept in session 24) costs 11."""

import sys
from pathlib import Path

import torch

from qerl_lib.kernels import nvfp4_gemv_cuda as C

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import repack_layout_search as search  # noqa: E402


def _layout_of_repack_codes() -> list[tuple[int, ...]]:
    """(m, e0, e1, sign) bit positions of pair p's first code in a repacked word, found by repacking words with
    one code bit set (and checking that the pair's second code sits 16 bits higher)."""
    layout = []
    for p in range(4):
        code = []
        for b in range(4):
            positions = []
            for nibble in (0, 1):  # the pair's first code (low nibble of byte p), then its second
                word = torch.zeros(1, 4, dtype=torch.uint8)  # one little-endian word: byte p holds the pair
                word[0, p] = (1 << b) << (4 * nibble)
                r = int.from_bytes(C.repack_codes(word).numpy().tobytes(), "little")
                assert r and r & (r - 1) == 0, "one code bit must give one repacked bit"
                positions.append(r.bit_length() - 1)
            assert positions[1] == positions[0] + 16
            code.append(positions[0])
        layout.append(tuple(code))
    return layout


def test_shipped_layout_and_the_cheapest_placement():
    layout = _layout_of_repack_codes()
    assert layout == [(3 * p, 3 * p + 1, 3 * p + 2, 12 + p) for p in range(4)]
    assert (search.layout_cost(tuple(layout), "bf16"), search.layout_cost(tuple(layout), "fp16")) == (14, 13)
    pareto = search._pareto(0)
    assert min(b for b, _ in pareto) == 11
    swapped = tuple((3 * p, 3 * p + 1, 3 * p + 2, 12 + (p ^ 1)) for p in range(4))
    assert (search.layout_cost(swapped, "bf16"), search.layout_cost(swapped, "fp16")) == (11, 14)
    assert pareto[(11, 14)] == swapped
