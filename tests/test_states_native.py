"""The kernels' state I/O, on the CPU: what forward.forward / backward.backward pass the kernels that read initial
states and write final states (state_mode, state_idx, the rows of h0 / ht) for each StateIO, every launch checked
against its cubin's parameter list in the manifest (a missing size or pointer is the error a GPU would give). The
GPU tests (tests/test_gpu_states.py) check what the kernels then compute."""
import ast

import pytest
from conftest import repo_text
import torch

from flash_qla import backward as bwd
from flash_qla import forward as fwd
from flash_qla import states
from flash_qla.tuning import settings
from flash_qla.validation import validate_inputs

STATE_KERNELS = {"gdn_fwd_fused", "gdn_fwd_chain", "gdn_bwd_recompute", "gdn_bwd_dh"}


def test_state_mode_bits_match_the_kernels():
    tree = ast.parse(repo_text("aot", "kernels", "state_io.py"))
    kernel_side = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   for t in n.targets}
    assert kernel_side == {"V_FIRST": states.V_FIRST, "READ_INDEXED": states.READ_INDEXED,
                           "WRITE_INDEXED": states.WRITE_INDEXED}


def inputs(N=4, tokens=8, hq=2, hv=4, K=128, V=128):
    T = N * tokens
    bf16 = torch.bfloat16
    x = dict(q=torch.randn(1, T, hq, K).to(bf16), k=torch.randn(1, T, hq, K).to(bf16),
             v=torch.randn(1, T, hv, V).to(bf16), g=-torch.rand(1, T, hv), beta=torch.rand(1, T, hv),
             cu=torch.arange(0, T + 1, tokens, dtype=torch.int32))
    problem = validate_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, x["cu"])
    return problem, x


def run_forward(problem, x, h0, output_final_state, io):
    return fwd.forward(problem, x["q"], x["k"], x["v"], x["g"], x["beta"], h0, output_final_state, x["cu"], False,
                       state_io=io)


def state_launches(seen):
    return [(n, s, p) for n, v, s, p in seen if n in STATE_KERNELS]


@pytest.mark.parametrize("fused", [True, False])
def test_v_first_dense_states(launches, monkeypatch, fused):
    monkeypatch.setattr(settings, "use_fused", fused)
    monkeypatch.setattr(settings, "force_segment_chunks", 0)
    problem, x = inputs()
    h0 = torch.randn(4, 4, 128, 128)  # [N, Hv, V, K]
    o, ht, _, _ = run_forward(problem, x, h0, True, states.StateIO(v_first=True))
    assert tuple(ht.shape) == (4, 4, 128, 128) and ht.dtype == torch.float32
    (name, sizes, ptrs), = state_launches(launches)
    assert name == ("gdn_fwd_fused" if fused else "gdn_fwd_chain")
    assert sizes["state_mode"] == states.V_FIRST and sizes["use_h0"] == 1 and sizes["store_ht"] == 1
    assert (sizes["h0_rows"], sizes["ht_rows"]) == (4, 4)
    assert ptrs["h0"] == h0.data_ptr() and ptrs["ht"] == ht.data_ptr()


@pytest.mark.parametrize("fused", [True, False])
def test_pool_read_and_written_in_place_through_the_index(launches, monkeypatch, fused):
    monkeypatch.setattr(settings, "use_fused", fused)
    monkeypatch.setattr(settings, "force_segment_chunks", 0)
    problem, x = inputs()
    pool = torch.randn(11, 4, 128, 128)
    idx = torch.tensor([3, -1, 10, 0], dtype=torch.int32)
    io = states.StateIO(v_first=True, index=idx, pool_read=True, write=pool)
    assert io.mode == states.V_FIRST | states.READ_INDEXED | states.WRITE_INDEXED
    _, ht, _, _ = run_forward(problem, x, pool, False, io)
    assert ht is pool  # the final states went into the pool's slots
    (name, sizes, ptrs), = state_launches(launches)
    assert sizes["state_mode"] == io.mode and sizes["store_ht"] == 1
    assert (sizes["h0_rows"], sizes["ht_rows"]) == (11, 11)
    assert ptrs["state_idx"] == idx.data_ptr() and ptrs["h0"] == pool.data_ptr() and ptrs["ht"] == pool.data_ptr()


def test_pool_read_with_no_final_state_stores_nothing(launches, monkeypatch):
    monkeypatch.setattr(settings, "force_segment_chunks", 0)
    problem, x = inputs()
    pool = torch.randn(6, 4, 128, 128)
    idx = torch.tensor([5, 4, -1, 1], dtype=torch.int32)
    _, ht, _, _ = run_forward(problem, x, pool, False, states.StateIO(index=idx, pool_read=True))
    assert ht.numel() == 0
    (_, sizes, ptrs), = state_launches(launches)
    assert sizes["state_mode"] == states.READ_INDEXED and sizes["store_ht"] == 0 and sizes["h0_rows"] == 6


def test_intra_card_cp_refuses_the_callers_layout(launches, monkeypatch):
    """CP's combine and per-segment states work in [.., K, V]: the caller converts around a CP call
    (native_state_io says so), and a forward asked otherwise stops before launching anything."""
    monkeypatch.setattr(settings, "force_segment_chunks", 1)
    problem, x = inputs(N=2, tokens=200)
    assert not fwd.native_state_io(problem, torch.bfloat16, torch.device("cpu"), False)
    assert not bwd.native_v_first(problem, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="intra-card CP"):
        run_forward(problem, x, torch.randn(2, 4, 128, 128), True, states.StateIO(v_first=True))
    assert not launches


def test_backward_reads_and_writes_v_first_states(launches, monkeypatch):
    monkeypatch.setattr(settings, "force_segment_chunks", 0)
    problem, x = inputs()
    assert bwd.native_v_first(problem, torch.bfloat16, torch.device("cpu"))
    h0, dht = torch.randn(4, 4, 128, 128), torch.randn(4, 4, 128, 128)
    do = torch.randn_like(x["v"])
    out = bwd.backward(problem, x["q"], x["k"], x["v"], x["g"], x["beta"], h0, x["cu"], False, do, dht,
                       v_first=True)
    dh0 = out[-1]
    assert tuple(dh0.shape) == (4, 4, 128, 128)
    modes = {n: s["state_mode"] for n, s, _ in state_launches(launches)}
    assert modes == {"gdn_bwd_recompute": states.V_FIRST, "gdn_bwd_dh": states.V_FIRST}
    dh = next(p for n, s, p in state_launches(launches) if n == "gdn_bwd_dh")
    assert dh["dht"] == dht.data_ptr() and dh["dh0"] == dh0.data_ptr()


def _plan(problem, initial_state, indices=None, v_first=False, inplace=False, output_state=None, final=False,
          grad=False):
    return states.plan(problem, torch.device("cpu"), initial_state, indices, v_first, inplace, output_state, final,
                       grad)


def test_native_io_covers_the_serving_calls_and_leaves_the_rest_to_torch():
    problem, _ = inputs()
    pool = torch.randn(9, 4, 128, 128)
    idx = torch.tensor([8, -1, 2, 0], dtype=torch.int64)
    # SGLang: pool + indices + inplace_update, V-first; the int64 table is taken as int32
    io = states.native_io(_plan(problem, pool, idx, v_first=True, inplace=True), pool, False, False)
    assert io.mode == states.V_FIRST | states.READ_INDEXED | states.WRITE_INDEXED and io.write is pool
    assert io.index.dtype == torch.int32 and io.index.tolist() == [8, -1, 2, 0]
    # FlashInfer: output_state receives the slots
    out = torch.zeros_like(pool)
    io = states.native_io(_plan(problem, pool, idx, output_state=out, final=True), pool, True, False)
    assert io.mode == states.READ_INDEXED | states.WRITE_INDEXED and io.write is out
    # a dense V-first state, with autograd too: read in place, final states in the caller's layout
    h0 = torch.randn(4, 4, 128, 128)
    assert states.native_io(_plan(problem, h0, v_first=True, final=True, grad=True), h0, True, True).mode == 1
    # torch's passes: a pool under autograd, a half-precision or strided state, pool + inplace + a dense result
    assert states.native_io(_plan(problem, pool, idx, inplace=True), pool, False, True) is None
    half = h0.half()
    assert states.native_io(_plan(problem, half, final=True), half, True, False) is None
    strided = h0.transpose(-1, -2)
    assert states.native_io(_plan(problem, strided, final=True), strided, True, False) is None
    assert states.native_io(_plan(problem, pool, idx, inplace=True, final=True), pool, True, False) is None
