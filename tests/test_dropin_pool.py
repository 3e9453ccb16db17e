"""The state pool of chunk_gated_delta_rule on CPU: initial_state_indices / state_indices, -1 padding, inplace_update,
output_state, repeated calls, errors, and that the pool path reads no tensor value on the host (meta tensors)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import flash_qla
from flash_qla import states
from flash_qla.validation import validate_inputs
from gdn_inputs import hard_inputs
from test_api import rel, token_loop

Hv, K, V = 2, 8, 4


def batch(lengths, seed=0):
    x = hard_inputs(lengths, 1, Hv, K, V, seed=seed, strong_decay=False)
    x.pop("initial_state")
    return x


def pool_of(S, seed=1, v_first=False, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shape = (S, Hv, V, K) if v_first else (S, Hv, K, V)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def expected(x, pool, indices, v_first=False):
    """The pool semantics written out: gather (zeros for negative), run the loop, scatter to live slots."""
    rows = [pool[i].double() if i >= 0 else torch.zeros_like(pool[0], dtype=torch.float64) for i in indices]
    h0 = torch.stack(rows)
    h0 = h0.transpose(-1, -2) if v_first else h0
    o, s = token_loop(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, h0, x["cu_seqlens"])
    s = s.transpose(-1, -2) if v_first else s
    after = pool.clone()
    for n, i in enumerate(indices):
        if i >= 0:
            after[i] = s[n].to(pool.dtype)
    return o, s, after


@pytest.mark.parametrize("v_first", [False, True])
def test_gather_padding_and_inplace_update(v_first):
    x = batch([5, 70, 3], seed=2)
    pool = pool_of(6, v_first=v_first)
    idx = [4, -1, 1]
    o_want, s_want, pool_want = expected(x, pool, idx, v_first)
    live = pool.clone()
    o, s = flash_qla.chunk_gated_delta_rule(**x, initial_state=live, output_final_state=True, state_v_first=v_first,
                                            initial_state_indices=torch.tensor(idx, dtype=torch.int32),
                                            inplace_update=True)
    assert rel(o, o_want) < 1e-10 and rel(s, s_want) < 1e-10
    assert rel(live, pool_want) < 1e-10
    for slot in (0, 2, 3, 5):  # untouched slots keep their bytes
        assert torch.equal(live[slot], pool[slot])


@pytest.mark.parametrize("idx", [[0, -1], [-1, 0], [-1, -1], [2, 0]])
def test_padding_never_clobbers_a_live_slot_zero(idx):
    """Padding entries are routed to slot 0 internally: whether slot 0 is live or not, it ends right."""
    x = batch([6, 9], seed=3)
    pool = pool_of(3, seed=4)
    _, _, pool_want = expected(x, pool, idx)
    live = pool.clone()
    flash_qla.chunk_gated_delta_rule(**x, initial_state=live, inplace_update=True,
                                     initial_state_indices=torch.tensor(idx, dtype=torch.int32))
    assert rel(live, pool_want) < 1e-10
    if 0 not in idx:
        assert torch.equal(live[0], pool[0])


def test_repeated_calls_continue_the_sequences():
    """Prefill in two calls through the pool equals one call over the whole sequences (serving's chunked prefill)."""
    whole = batch([30, 50], seed=5)
    cu = whole["cu_seqlens"].tolist()
    cut = [12, 20]  # tokens of each sequence in the first call
    first, second = {}, {}
    for n in ("q", "k", "v", "g", "beta"):
        t = whole[n][0]
        first[n] = torch.cat([t[cu[i]:cu[i] + cut[i]] for i in range(2)])[None]
        second[n] = torch.cat([t[cu[i] + cut[i]:cu[i + 1]] for i in range(2)])[None]
    pool = torch.zeros(4, Hv, K, V, dtype=torch.float64)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    o1, _ = flash_qla.chunk_gated_delta_rule(**first, cu_seqlens=torch.tensor([0, 12, 32]), initial_state=pool,
                                             initial_state_indices=idx, inplace_update=True)
    o2, _ = flash_qla.chunk_gated_delta_rule(**second, cu_seqlens=torch.tensor([0, 18, 48]), initial_state=pool,
                                             initial_state_indices=idx, inplace_update=True)
    o, s = flash_qla.chunk_gated_delta_rule(**whole, output_final_state=True)
    assert rel(pool[[3, 1]], s) < 1e-10
    o_seq = torch.cat([o1[0, :12], o2[0, :18], o1[0, 12:], o2[0, 18:]])
    assert rel(o_seq, o[0]) < 1e-10
    assert torch.equal(pool[0], torch.zeros_like(pool[0])) and torch.equal(pool[2], torch.zeros_like(pool[2]))


def test_flashinfer_spelling_output_state():
    x = batch([7, 11], seed=6)
    pool = pool_of(5, seed=7, v_first=True)
    idx = torch.tensor([2, 4], dtype=torch.int32)
    _, s_want, pool_want = expected(x, pool, [2, 4], v_first=True)
    # a separate output pool: the input pool is untouched, the output pool's other slots too
    out_pool = torch.full_like(pool, 7.0)
    o, ret = flash_qla.chunk_gated_delta_rule(**x, initial_state=pool, state_indices=idx, output_state=out_pool,
                                              output_final_state=True, state_v_first=True)
    assert ret is out_pool and rel(out_pool[[2, 4]], s_want) < 1e-10
    assert torch.equal(out_pool[[0, 1, 3]], torch.full_like(pool[[0, 1, 3]], 7.0))
    # in place: output_state is initial_state
    live = pool.clone()
    flash_qla.chunk_gated_delta_rule(**x, initial_state=live, state_indices=idx, output_state=live,
                                     output_final_state=True, state_v_first=True)
    assert rel(live, pool_want) < 1e-10
    # no indices: a dense [N, ...] buffer
    dense = torch.empty(2, Hv, V, K, dtype=torch.float64)
    _, ret = flash_qla.chunk_gated_delta_rule(**x, initial_state=pool[[2, 4]], output_state=dense,
                                              output_final_state=True, state_v_first=True)
    assert ret is dense and rel(dense, s_want) < 1e-10


def test_dense_inplace_update_keeps_the_backward_right():
    """Without indices, inplace_update overwrites a dense initial_state; autograd still sees the values it started
    from (the gradient of o with respect to q equals that of a call without the write)."""
    x = hard_inputs([9, 4], 1, Hv, K, V, seed=8)
    h0 = x.pop("initial_state")
    q = x.pop("q").requires_grad_()
    live = h0.clone()
    o, _ = flash_qla.chunk_gated_delta_rule(q, **x, initial_state=live, inplace_update=True)
    dq, = torch.autograd.grad(o.sum(), q)
    o2, s2 = flash_qla.chunk_gated_delta_rule(q, **x, initial_state=h0, output_final_state=True)
    dq2, = torch.autograd.grad(o2.sum(), q)
    assert torch.equal(live, s2.detach()) and torch.allclose(dq, dq2, rtol=1e-12, atol=1e-12)


def test_gradient_flows_into_the_pool_gather():
    x = batch([6, 5], seed=9)
    pool = pool_of(4, seed=10).requires_grad_()
    idx = torch.tensor([3, -1], dtype=torch.int32)
    o, s = flash_qla.chunk_gated_delta_rule(**x, initial_state=pool, initial_state_indices=idx, output_final_state=True)
    dpool, = torch.autograd.grad(o.sum() + s.sum(), pool)
    h0 = torch.stack([pool[3].detach(), torch.zeros_like(pool[0]).detach()]).requires_grad_()
    o2, s2 = flash_qla.chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True)
    dh0, = torch.autograd.grad(o2.sum() + s2.sum(), h0)
    assert torch.allclose(dpool[3], dh0[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(dpool[[0, 1, 2]], torch.zeros_like(dpool[[0, 1, 2]]))


def test_half_pool_is_read_in_float32_and_written_in_its_dtype():
    x = hard_inputs([8, 6], 1, Hv, K, V, dtype=torch.float32, seed=11)
    x.pop("initial_state")
    pool = pool_of(3, seed=12, dtype=torch.bfloat16)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    live = pool.clone()
    _, s = flash_qla.chunk_gated_delta_rule(**x, initial_state=live, initial_state_indices=idx, inplace_update=True,
                                            output_final_state=True)
    _, s_dense = flash_qla.chunk_gated_delta_rule(**x, initial_state=pool[[1, 2]].float(), output_final_state=True)
    assert s.dtype == torch.float32 and torch.equal(s, s_dense)
    assert live.dtype == torch.bfloat16 and torch.equal(live[[1, 2]], s.bfloat16()) and torch.equal(live[0], pool[0])


@settings(max_examples=15, deadline=None)
@given(data=st.data(), S=st.integers(1, 6), lengths=st.lists(st.integers(0, 20), min_size=1, max_size=4),
       v_first=st.booleans())
def test_pool_property(data, S, lengths, v_first):
    """Random pools, lengths (empty sequences too) and slot assignments with padding, against the written-out
    meaning."""
    if sum(lengths) == 0:
        lengths = lengths + [1]
    N = len(lengths)
    live_slots = data.draw(st.lists(st.integers(0, S - 1), min_size=N, max_size=N, unique=True)
                           if N <= S else st.just([]))
    pads = data.draw(st.lists(st.booleans(), min_size=N, max_size=N))
    idx = [(-1 if (p or not live_slots) else live_slots[n]) for n, p in enumerate(pads)]
    x = batch(lengths, seed=S * 7 + N)
    pool = pool_of(S, seed=N, v_first=v_first)
    o_want, s_want, pool_want = expected(x, pool, idx, v_first)
    live = pool.clone()
    o, s = flash_qla.chunk_gated_delta_rule(**x, initial_state=live, initial_state_indices=torch.tensor(idx),
                                            inplace_update=True, output_final_state=True, state_v_first=v_first)
    assert rel(o, o_want) < 1e-10 and rel(s, s_want) < 1e-10
    assert rel(live, pool_want) < 1e-10


def test_pool_path_reads_no_value_on_the_host():
    """The gather and the write-back run on meta tensors (which refuse .item() / .tolist()): nothing in them depends on
    reading a device value back, so a CUDA call neither synchronises nor breaks graph capture."""
    q = torch.empty(1, 12, 1, K, device="meta")
    v = torch.empty(1, 12, Hv, V, device="meta")
    g = torch.empty(1, 12, Hv, device="meta")
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    problem = validate_inputs(q, q, v, g, g, None, None, cu)
    pool = torch.empty(9, Hv, V, K, device="meta")
    idx = torch.empty(3, dtype=torch.int32, device="meta")
    plan = states.plan(problem, q.device, pool, idx, True, True, None, True)
    h0 = states.initial_states(plan, pool)
    assert h0.shape == (3, Hv, K, V) and h0.device.type == "meta"
    final = states.finish(plan, torch.empty(3, Hv, K, V, device="meta"), True)
    assert final.shape == (3, Hv, V, K)


def args(**over):
    x = batch([4, 6], seed=13)
    x.update(initial_state=pool_of(3), initial_state_indices=torch.tensor([0, 2], dtype=torch.int32))
    x.update(over)
    return x


@pytest.mark.parametrize("over,exc,match", [
    (dict(initial_state=None), ValueError, r"initial_state_indices \(state_indices\) needs initial_state"),
    (dict(initial_state_indices=torch.tensor([0, 3], dtype=torch.int32)), ValueError,
     r"names slot 3 of a pool of S = 3 slots"),
    (dict(initial_state_indices=torch.tensor([1, 1], dtype=torch.int32)), ValueError,
     r"names slot 1 for more than one sequence"),
    (dict(initial_state_indices=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError,
     r"one slot per sequence \(N = 2\)"),
    (dict(initial_state_indices=torch.tensor([0.0, 1.0])), TypeError, r"must have dtype int32"),
    (dict(initial_state_indices=[0, 1]), TypeError, r"must be an int32 torch.Tensor"),
    (dict(state_indices=torch.tensor([0, 1], dtype=torch.int32)), ValueError, r"not both"),
    (dict(initial_state=torch.zeros(3, Hv, V, K + 1, dtype=torch.float64)), ValueError,
     r"the state pool\) must have shape \[S, Hv, K, V\] = \(S, 2, 8, 4\)"),
    (dict(inplace_update=True, output_state=torch.zeros(3, Hv, K, V, dtype=torch.float64), output_final_state=True),
     ValueError, r"not both"),
    (dict(output_state=torch.zeros(3, Hv, K, V, dtype=torch.float64)), ValueError,
     r"output_state .* only output_final_state=True produces"),
    (dict(initial_state=pool_of(3).requires_grad_(), inplace_update=True), ValueError,
     r"requires grad; in-place state writes are for inference"),
    (dict(initial_state_indices=None, inplace_update=True, initial_state=None), ValueError,
     r"inplace_update=True writes the final states into initial_state, which is None"),
])
def test_pool_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        flash_qla.chunk_gated_delta_rule(**args(**over))
