"""aot/kernels/fragment_sums.py's part layout: the per-warp column parts and per-warpgroup row parts of a wgmma
accumulator, as its C helpers leave them, add up to the matrix's column and row sums (CPU)."""
import importlib.util
import pathlib

import pytest
import torch

# plain Python: loaded by file, without the aot package (whose kernels import tilelang)
_spec = importlib.util.spec_from_file_location(
    "fragment_sums", pathlib.Path(__file__).parents[1] / "aot" / "kernels" / "fragment_sums.py")
fs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fs)


def scatter(m, nj):
    """Each of 256 threads' accumulator elements of the 64 x (16 nj) matrix m; every element exactly once."""
    seen = set()
    acc = []
    for t in range(256):
        row = []
        for s in range(4 * nj):
            r, c = fs.element_position(t, s, nj)
            assert (r, c) not in seen
            seen.add((r, c))
            row.append(m[r, c].item())
        acc.append(row)
    assert len(seen) == m.numel()
    return acc


def test_column_parts_add_up_to_column_sums():
    m = torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    parts = fs.col_parts(scatter(m, 4))
    part = torch.tensor(parts, dtype=torch.float64).view(4, 64)
    torch.testing.assert_close(part.sum(0), m.sum(0))
    torch.testing.assert_close(torch.tensor([fs.col_total(parts, i) for i in range(64)], dtype=torch.float64), m.sum(0))
    torch.testing.assert_close(part, m.view(4, 16, 64).sum(1))  # part[w] holds warp w's 16 rows


@pytest.mark.parametrize("K", [64, 128])
def test_row_parts_add_up_to_row_sums(K):
    m = torch.randn(64, K, dtype=torch.float64, generator=torch.Generator().manual_seed(K))
    parts = fs.row_parts(scatter(m, K // 16), K // 16)
    part = torch.tensor(parts, dtype=torch.float64).view(2, 64)
    torch.testing.assert_close(part.sum(0), m.sum(1))
    torch.testing.assert_close(torch.tensor([fs.row_total(parts, i) for i in range(64)], dtype=torch.float64), m.sum(1))
    torch.testing.assert_close(part, m.view(64, 2, K // 2).sum(2).T)  # part[g] holds warpgroup g's columns
