"""chunk_passes.py's element order, on the CPU: each helper call's elements sit where the accumulator layout
(fragment_sums.element_position) puts them, and ldmatrix / stmatrix .x4 at block_rows addresses move exactly those
elements (register q of lane l: row l / 4 of matrix q, the pair of columns 2 (l % 4), + 1)."""
import pytest

from aot.kernels.block_fragments import block_rows
from aot.kernels.chunk_passes import block_origin, call_elements
from aot.kernels.fragment_sums import element_position


@pytest.mark.parametrize("nj", [4, 8])
def test_call_elements_follow_the_accumulator_layout(nj):
    for t in range(256):
        covered = [i for jj in range(nj // 2) for i, _, _ in call_elements(t, nj, jj)]
        assert covered == list(range(4 * nj))  # every element once, in order
        for jj in range(nj // 2):
            for i, row, col in call_elements(t, nj, jj):
                assert element_position(t, i, nj) == (row, col)


@pytest.mark.parametrize("nj", [4, 8])
def test_x4_matrices_at_block_rows_addresses_move_the_calls_elements(nj):
    for t in range(256):
        lane, w, g = t % 32, t % 128 // 32, t // 128
        for jj in range(nj // 2):
            R, C = block_origin(w, g, nj, jj)
            # matrix m's row r starts where lane 8 m + r points; lane l receives row l / 4 of each matrix
            moved = []
            for m in range(4):
                row, col = block_rows(8 * m + lane // 4, R, C)
                moved += [(row, col + 2 * (lane % 4) + e) for e in range(2)]
            assert moved == [(row, col) for _, row, col in call_elements(t, nj, jj)]
