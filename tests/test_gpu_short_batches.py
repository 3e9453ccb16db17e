"""gdn_fwd_fused on batches of many short sequences, where each persistent CTA walks several (sequence, v-head,
V block) items one after the other (more items than aot/kernels/gdn_fwd_fused.PERSISTENT_CTAS): against the
float64 reference, and the V-first layout and a state pool against the plain call bit for bit (GPU machine only).
Lengths mix empty and one-token sequences with one-chunk and multi-chunk ones, so items of no chunk, of one and of
several follow each other inside a CTA."""
import random

import pytest
import torch

from flash_qla import reference
from flash_qla import forward as fwd
from flash_qla.states import StateIO
from flash_qla.tuning import settings
from flash_qla.validation import validate_inputs

pytestmark = pytest.mark.gpu
PERSISTENT_CTAS = 528  # aot/kernels/gdn_fwd_fused.py


def lengths(n, seed):
    rng = random.Random(seed)
    return [rng.choice((0, 1, 3, 8, 8, 16, 31, 64, 65, 130)) for _ in range(n)]


def inputs(lens, hq, hv, K, V, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, dev, bf16 = sum(lens), "cuda", torch.bfloat16
    x = dict(q=torch.nn.functional.normalize(torch.randn(1, T, hq, K, device=dev, generator=gen), dim=-1).to(bf16),
             k=torch.nn.functional.normalize(torch.randn(1, T, hq, K, device=dev, generator=gen), dim=-1).to(bf16),
             v=torch.randn(1, T, hv, V, device=dev, generator=gen).to(bf16),
             g=torch.nn.functional.logsigmoid(torch.randn(1, T, hv, device=dev, generator=gen) + 2),
             beta=torch.rand(1, T, hv, device=dev, generator=gen),
             cu=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev))
    x["h0"] = torch.randn(len(lens), hv, K, V, device=dev, generator=gen)
    x["problem"] = validate_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, x["cu"])
    return x


def forward(x, h0, final, io=StateIO()):
    o, ht, _, _ = fwd.forward(x["problem"], x["q"], x["k"], x["v"], x["g"], x["beta"], h0, final, x["cu"], False,
                              state_io=io)
    return o, ht


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    monkeypatch.setattr(settings, "use_fused", True)
    monkeypatch.setattr(settings, "force_segment_chunks", 0)
    monkeypatch.setattr(settings, "poison_outputs", True)


# (K, V, BV): one V block (the whole state contiguous in both layouts) and two (K-first rows of BV floats)
BUILDS = [(128, 128, 128), (128, 128, 64), (64, 256, 128)]


@pytest.mark.parametrize("K,V,BV", BUILDS)
def test_many_items_per_cta_match_fp64_reference(K, V, BV, monkeypatch):
    monkeypatch.setattr(settings, "force_block_v", BV)
    lens = lengths(90, seed=K + V + BV)
    hq, hv = 4, 16
    assert len(lens) * hv * (V // BV) > 2 * PERSISTENT_CTAS  # every CTA walks two items or more
    x = inputs(lens, hq, hv, K, V, seed=1)
    o, ht = forward(x, x["h0"], True)
    ref_o, ref_ht = reference.chunked_gated_delta_rule(
        x["q"].double(), x["k"].double(), x["v"].double(), x["g"].double(), x["beta"].double(),
        initial_state=x["h0"].double(), output_final_state=True, cu_seqlens=x["cu"].cpu())
    assert rel(o, ref_o) < 1e-2 and rel(ht, ref_ht) < 1e-2
    empty = torch.tensor([n == 0 for n in lens], device="cuda")
    assert torch.equal(ht[empty], x["h0"][empty])  # an item of no chunk passes its state through
    o2, ht2 = forward(x, x["h0"], True)
    assert torch.equal(o2, o) and torch.equal(ht2, ht)  # bit-identical repeats


@pytest.mark.parametrize("K,V,BV", BUILDS)
def test_many_items_v_first_and_pool_match_the_plain_call(K, V, BV, monkeypatch):
    monkeypatch.setattr(settings, "force_block_v", BV)
    lens = lengths(80, seed=7)
    hv = 16
    x = inputs(lens, 4, hv, K, V, seed=2)
    N = len(lens)
    o_ref, ht_ref = forward(x, x["h0"], True)
    o_vf, ht_vf = forward(x, x["h0"].transpose(-1, -2).contiguous(), True, StateIO(v_first=True))
    assert torch.equal(o_vf, o_ref) and torch.equal(ht_vf, ht_ref.transpose(-1, -2))
    for v_first in (False, True):
        S = 2 * N
        pool = torch.randn(S, hv, K, V, device="cuda")
        idx = torch.randperm(S, device="cuda")[:N].to(torch.int32)
        idx[::7] = -1  # padding: starts from zero, writes nothing
        rows = idx.long().clamp_min(0)
        h0 = torch.where((idx >= 0).view(-1, 1, 1, 1), pool[rows], 0.0)
        o_want, ht_want = forward(x, h0, True)
        layout = (lambda t: t.transpose(-1, -2).contiguous()) if v_first else (lambda t: t.clone())
        work = layout(pool)
        want = work.clone()
        live = idx >= 0
        want[idx[live].long()] = layout(ht_want[live])
        o, _ = forward(x, work, False, StateIO(v_first=v_first, index=idx, pool_read=True, write=work))
        assert torch.equal(o, o_want) and torch.equal(work, want)


@pytest.mark.parametrize("K,V,BV", BUILDS)
def test_any_grid_cap_gives_the_same_bits(K, V, BV, monkeypatch):
    """The persistent grid's cap (the planner's one CTA an SM on one-chunk batches, the default 528, or a few CTAs
    walking hundreds of items each) changes which CTA runs an item, never its arithmetic."""
    monkeypatch.setattr(settings, "force_block_v", BV)
    rng = random.Random(5)
    lens = [rng.choice((1, 8, 40, 64)) for _ in range(120)]
    x = inputs(lens, 4, 8, K, V, seed=3)
    got = {}
    for cap in (None, torch.cuda.get_device_properties(0).multi_processor_count, 7):
        monkeypatch.setattr(settings, "fused_ctas_max", cap)
        got[cap] = forward(x, x["h0"], True)
    first = got[None]
    for cap, (o, ht) in got.items():
        assert torch.equal(o, first[0]) and torch.equal(ht, first[1]), cap
    ref_o, ref_ht = reference.chunked_gated_delta_rule(
        x["q"].double(), x["k"].double(), x["v"].double(), x["g"].double(), x["beta"].double(),
        initial_state=x["h0"].double(), output_final_state=True, cu_seqlens=x["cu"].cpu())
    assert rel(first[0], ref_o) < 1e-2 and rel(first[1], ref_ht) < 1e-2


def test_one_chunk_batches_plan_one_cta_an_sm():
    x = inputs([48] * 64, 2, 8, 128, 128, seed=4)
    plan = fwd.forward_plan(x["problem"], "bf16", torch.device("cuda"), False, False)
    assert plan.path == "fused" and plan.fused_ctas == torch.cuda.get_device_properties(0).multi_processor_count
