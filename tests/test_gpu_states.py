"""The kernels' own state I/O on the GPU (flash_qla.states.StateIO): the V-first layout and a state pool read and
written through an index table, against the plain [N, Hv, K, V] call on the same numbers. The kernels load the same
values either way, so o, the final states and every gradient must match bit for bit; padding entries (-1) start
from zero and write nothing, and the pool's other slots stay as they were."""
import pytest
import torch

from flash_qla import backward as bwd
from flash_qla import forward as fwd
from flash_qla.states import StateIO
from flash_qla.tuning import settings
from flash_qla.validation import validate_inputs

pytestmark = pytest.mark.gpu
LENGTHS = [1, 63, 64, 65, 130, 7, 200]


def inputs(K, V, dtype=torch.bfloat16, hq=2, hv=4, seed=0, lengths=LENGTHS):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, dev = sum(lengths), "cuda"
    x = dict(q=torch.nn.functional.normalize(torch.randn(1, T, hq, K, device=dev, generator=gen), dim=-1).to(dtype),
             k=torch.nn.functional.normalize(torch.randn(1, T, hq, K, device=dev, generator=gen), dim=-1).to(dtype),
             v=torch.randn(1, T, hv, V, device=dev, generator=gen).to(dtype),
             g=torch.nn.functional.logsigmoid(torch.randn(1, T, hv, device=dev, generator=gen)),
             beta=torch.rand(1, T, hv, device=dev, generator=gen),
             cu=torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev))
    x["problem"] = validate_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, x["cu"])
    return x


def forward(x, h0, final, io=StateIO()):
    o, ht, _, _ = fwd.forward(x["problem"], x["q"], x["k"], x["v"], x["g"], x["beta"], h0, final, x["cu"], False,
                              state_io=io)
    return o, ht


@pytest.fixture(params=["fused", "chain"])
def path(request, monkeypatch):
    monkeypatch.setattr(settings, "use_fused", request.param == "fused")
    monkeypatch.setattr(settings, "force_segment_chunks", 0)
    monkeypatch.setattr(settings, "poison_outputs", True)
    return request.param


@pytest.mark.parametrize("K,V", [(128, 128), (64, 256), (128, 64)])
def test_v_first_forward_is_the_plain_one_transposed(path, K, V):
    x = inputs(K, V)
    N = x["problem"].num_seqs
    h0 = torch.randn(N, 4, K, V, device="cuda")
    o, ht = forward(x, h0, True)
    o_vf, ht_vf = forward(x, h0.transpose(-1, -2).contiguous(), True, StateIO(v_first=True))
    assert tuple(ht_vf.shape) == (N, 4, V, K)
    assert torch.equal(o_vf, o) and torch.equal(ht_vf, ht.transpose(-1, -2))


@pytest.mark.parametrize("v_first", [False, True])
def test_pool_read_and_written_in_place(path, v_first):
    K = V = 128
    x = inputs(K, V, seed=3)
    N = x["problem"].num_seqs
    S = 3 * N
    pool = torch.randn(S, 4, K, V, device="cuda")
    idx = torch.randperm(S, device="cuda")[:N].to(torch.int32)
    idx[[1, 4]] = -1  # padding: starts from zero, writes nothing
    rows = idx.long().clamp_min(0)
    h0 = torch.where((idx >= 0).view(-1, 1, 1, 1), pool[rows], 0.0)
    o_ref, ht_ref = forward(x, h0, True)
    layout = (lambda t: t.transpose(-1, -2).contiguous()) if v_first else (lambda t: t.clone())
    work = layout(pool)
    before = work.clone()
    o, ht = forward(x, work, False, StateIO(v_first=v_first, index=idx, pool_read=True, write=work))
    assert ht is work and torch.equal(o, o_ref)
    want = before.clone()
    live = idx >= 0
    want[idx[live].long()] = layout(ht_ref[live])
    assert torch.equal(work, want)  # the live slots hold the final states; padding and unnamed slots are untouched


def test_pool_written_into_another_pool(path):
    """FlashInfer's output_state: read from one pool, write the same slots of another."""
    x = inputs(128, 128, seed=5)
    N = x["problem"].num_seqs
    pool = torch.randn(2 * N, 4, 128, 128, device="cuda")
    out = torch.full_like(pool, 7.0)
    idx = torch.arange(2 * N - 1, -1, -2, device="cuda", dtype=torch.int32)
    o_ref, ht_ref = forward(x, pool[idx.long()], True)
    o, ht = forward(x, pool, False, StateIO(index=idx, pool_read=True, write=out))
    assert ht is out and torch.equal(o, o_ref)
    assert torch.equal(out[idx.long()], ht_ref)
    other = torch.ones(2 * N, dtype=torch.bool, device="cuda")
    other[idx.long()] = False
    assert bool((out[other] == 7.0).all())


@pytest.mark.parametrize("K,V", [(128, 128), (64, 128)])
def test_v_first_backward_is_the_plain_one_transposed(K, V, monkeypatch):
    monkeypatch.setattr(settings, "force_segment_chunks", 0)
    monkeypatch.setattr(settings, "poison_outputs", True)
    x = inputs(K, V, seed=7)
    N, p = x["problem"].num_seqs, x["problem"]
    assert bwd.native_v_first(p, torch.bfloat16, torch.device("cuda"))
    h0, dht = torch.randn(N, 4, K, V, device="cuda"), torch.randn(N, 4, K, V, device="cuda")
    do = torch.randn_like(x["v"])
    args = (p, x["q"], x["k"], x["v"], x["g"], x["beta"])
    plain = bwd.backward(*args, h0, x["cu"], False, do, dht)
    vf = bwd.backward(*args, h0.transpose(-1, -2).contiguous(), x["cu"], False, do, dht.transpose(-1, -2).contiguous(),
                      v_first=True)
    for a, b in zip(plain[:5], vf[:5]):
        assert torch.equal(a, b)
    assert tuple(vf[5].shape) == (N, 4, V, K) and torch.equal(vf[5], plain[5].transpose(-1, -2))
