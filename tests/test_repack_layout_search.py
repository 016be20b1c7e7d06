"""The repacked layout's claim, checked: the kernel's layout (as `repack_codes` writes it) is the one
`benchmarks/repack_layout_search.py` names, and no placement of the bits costs bf16 fewer instructions."""

import importlib.util
from pathlib import Path

import torch

from qerl_lib.kernels import nvfp4_gemv_cuda as C

ROOT = Path(__file__).resolve().parents[1]


def _search():
    spec = importlib.util.spec_from_file_location("repack_layout_search", ROOT / "benchmarks/repack_layout_search.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _layout_of_repack_codes() -> list[tuple[int, ...]]:
    """(m, e0, e1, sign) bit positions of pair p's first code in a repacked word, found by repacking words with
    one code bit set (and checking that the pair's second code sits 16 bits higher)."""
    layout = []
    for p in range(4):
        code = []
        for b in range(4):
            positions = []
            for nibble in (0, 1):  # the pair's first code (low nibble of byte p), then its second
                word = torch.tensor([(1 << b) << (8 * p + 4 * nibble)], dtype=torch.int64).to(torch.int32)
                r = int(C.repack_codes(word.view(torch.uint8).reshape(1, 4)).view(torch.int32)) & 0xFFFFFFFF
                assert r and r & (r - 1) == 0, "one code bit must give one repacked bit"
                positions.append(r.bit_length() - 1)
            assert positions[1] == positions[0] + 16
            code.append(positions[0])
        layout.append(tuple(code))
    return layout


def test_repack_codes_writes_the_searched_layout_and_it_is_the_cheapest_for_bf16():
    search = _search()
    layout = _layout_of_repack_codes()
    assert layout == [(0, 1, 2, 13), (3, 4, 5, 12), (6, 7, 8, 15), (9, 10, 11, 14)]
    pareto = search._pareto(0)
    best_bf16 = min(b for b, _ in pareto)
    assert search.layout_cost(tuple(layout), "bf16") == best_bf16 == 11
    assert search.layout_cost(tuple(layout), "fp16") == 14
    # the session-16 layout (sign of pair p at 12 + p) cost bf16 three more per word
    assert search.layout_cost(tuple((3 * p, 3 * p + 1, 3 * p + 2, 12 + p) for p in range(4)), "bf16") == 14
