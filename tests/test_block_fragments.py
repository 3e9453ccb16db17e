"""The 16 x 16 block addresses of aot/kernels/block_fragments.py against the PTX semantics of ldmatrix / stmatrix and
the m16n8k16 fragments, and the block schedule of inverse_mma.invert_gated against the exact inverse (CPU)."""
import importlib.util
import pathlib

import pytest
import torch

# block_fragments.py is plain Python: loaded by file, without the aot package (whose kernels import tilelang)
_spec = importlib.util.spec_from_file_location(
    "block_fragments", pathlib.Path(__file__).parents[1] / "aot" / "kernels" / "block_fragments.py")
bf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bf)


def ldmatrix(tile, address, trans=False):
    """regs[lane][i] = the pair thread `lane` receives from matrix i of an .x4 ldmatrix (lane l addresses row l % 8 of
    matrix l // 8, 8 contiguous elements)."""
    mats = [[tile[r, c:c + 8] for r, c in (address(8 * i + j) for j in range(8))] for i in range(4)]
    mats = [torch.stack(m) for m in mats]
    out = []
    for t in range(32):
        g, q = t // 4, t % 4
        if trans:
            out.append([(m[2 * q, g].item(), m[2 * q + 1, g].item()) for m in mats])
        else:
            out.append([(m[g, 2 * q].item(), m[g, 2 * q + 1].item()) for m in mats])
    return out


def a_fragment(a):
    """m16n8k16 A fragment of a 16 x 16 matrix, per lane: a0..a3."""
    return [[(a[r, c].item(), a[r, c + 1].item()) for r, c in
             ((t // 4, 2 * (t % 4)), (t // 4 + 8, 2 * (t % 4)), (t // 4, 2 * (t % 4) + 8), (t // 4 + 8, 2 * (t % 4) + 8))]
            for t in range(32)]


def b_fragments(b):
    """The two m16n8k16 B fragments (n-tiles 0 and 1) of a 16 (k) x 16 (n) matrix, per lane: b0, b1 of tile 0, then
    of tile 1."""
    return [[(b[k, n].item(), b[k + 1, n].item()) for n0 in (0, 8) for k, n in
             ((2 * (t % 4), n0 + t // 4), (2 * (t % 4) + 8, n0 + t // 4))] for t in range(32)]


def accumulator(x):
    """8 floats a lane of a 16 x 16 accumulator (two m16n8 tiles): c0..c3 of columns 0-7, then of columns 8-15."""
    return [[x[r, c].item() for c0 in (0, 8) for r, c in
             ((t // 4, c0 + 2 * (t % 4)), (t // 4, c0 + 2 * (t % 4) + 1),
              (t // 4 + 8, c0 + 2 * (t % 4)), (t // 4 + 8, c0 + 2 * (t % 4) + 1))] for t in range(32)]


TILE = torch.arange(64 * 64, dtype=torch.float64).reshape(64, 64)


@pytest.mark.parametrize("row,col", [(0, 0), (16, 32), (48, 16)])
def test_block_addresses_give_the_operands_they_are_used_for(row, col):
    block = TILE[row:row + 16, col:col + 16]
    rows = lambda lane: bf.block_rows(lane, row, col)  # noqa: E731
    cols = lambda lane: bf.block_cols(lane, row, col)  # noqa: E731
    assert ldmatrix(TILE, rows) == a_fragment(block)                    # A = the block
    assert ldmatrix(TILE, rows, trans=True) == b_fragments(block)       # B = the block ([k, n] storage)
    assert ldmatrix(TILE, cols) == b_fragments(block.T)                 # B = its transpose ([n, k] storage)
    assert ldmatrix(TILE, cols, trans=True) == a_fragment(block.T)      # A = its transpose


def test_accumulator_pairs_are_the_fragments_the_helpers_pack():
    x = torch.randn(16, 16, dtype=torch.float64)
    acc = accumulator(x)
    # fqla_inv_y_*: the B operand of X from X^T's accumulator, pairs (0, 1), (4, 5), (2, 3), (6, 7)
    assert [[(c[0], c[1]), (c[4], c[5]), (c[2], c[3]), (c[6], c[7])] for c in accumulator(x.T)] == b_fragments(x)
    # fqla_stsm_* / fqla_inv_store_neg_*: stmatrix of pairs (0, 1), (2, 3), (4, 5), (6, 7) at block_rows addresses
    # writes the matrix (the stored registers are what ldmatrix at the same addresses reads back)
    assert [[(c[0], c[1]), (c[2], c[3]), (c[4], c[5]), (c[6], c[7])] for c in acc] == \
        ldmatrix(x, lambda lane: bf.block_rows(lane, 0, 0))


def agb_by_schedule(G, beta, rnd):
    """invert_gated's blocks in its order: diagonal blocks by substitution, then Agb_rc = -Agb_rr G_rc Agb_cc by its
    two levels, every product operand rounded by rnd."""
    B = 16
    agb = torch.zeros(64, 64, dtype=torch.float64)
    blk = lambda m, r, c: m[r * B:r * B + B, c * B:c * B + B]  # noqa: E731
    for d in range(4):
        L = torch.eye(B, dtype=torch.float64) + torch.tril(beta[d * B:d * B + B, None] * blk(G, d, d), -1)
        blk(agb, d, d)[:] = rnd(torch.linalg.inv(L) * beta[None, d * B:d * B + B])
    g = rnd(G)
    for r in (1, 3):
        xt = blk(agb, r - 1, r - 1).T @ blk(g, r, r - 1).T
        blk(agb, r, r - 1)[:] = rnd(-(blk(agb, r, r) @ rnd(xt).T))
    out = agb.clone()
    for r3 in (2, 3):
        for c3 in (0, 1):
            x = {m: sum(blk(g, m, mm) @ blk(agb, mm, c3) for mm in range(c3, 2)) for m in range(2, r3 + 1)}
            blk(out, r3, c3)[:] = rnd(-sum(blk(agb, r3, m) @ rnd(x[m]) for m in x))
    return out


@pytest.mark.parametrize("decay", [0.0, 0.5, 8.0])
def test_the_block_schedule_is_the_inverse(decay):
    gen = torch.Generator().manual_seed(int(decay * 10))
    k = torch.nn.functional.normalize(torch.randn(64, 128, generator=gen, dtype=torch.float64), dim=-1)
    gamma = torch.cumsum(-decay * torch.rand(64, generator=gen, dtype=torch.float64), 0)
    G = torch.tril(torch.exp(gamma[:, None] - gamma[None, :])) * (k @ k.T)
    beta = 2 * torch.rand(64, generator=gen, dtype=torch.float64)
    exact = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + torch.tril(beta[:, None] * G, -1)) * beta[None]
    assert torch.allclose(agb_by_schedule(G, beta, lambda t: t), exact, atol=1e-10)
    bf16 = agb_by_schedule(G, beta, lambda t: t.to(torch.bfloat16).to(torch.float64))
    assert (bf16 - exact).norm() / exact.norm() < 1e-2
