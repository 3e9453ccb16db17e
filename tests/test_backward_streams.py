"""The backward's streams, on the CPU: the save build (gdn_bwd_recompute) runs on a side stream above the priority of
the caller's, where the dh chain runs, so that when both become ready after gdn_prepare the device hands out the save
build's CTAs first, as CUDA-graph replay orders them. Handed out second, they found the SMs held by the dh chain's
CTAs in some eager calls and waited for them to end (launch.SIDE_PRIORITY)."""
import itertools
import types

import pytest
import torch

from flash_qla import backward as bwd
from flash_qla import forward as fwd
from flash_qla import launch
from flash_qla.tuning import settings
from flash_qla.validation import validate_inputs

CALLER = 0  # the caller's stream, at torch's default priority 0


class FakeStream:
    """torch.cuda.Stream on the CPU: a distinct handle and the priority it was made with."""
    handles = itertools.count(1)

    def __init__(self, device=None, priority=0):
        self.cuda_stream = next(self.handles)
        self.priority = priority


@pytest.fixture
def ops(launches, monkeypatch):
    """(kernel, build mode, stream priority) of each launch, in issue order."""
    seen = []
    priority_of = {CALLER: 0}
    recorded = fwd.launch  # the launches fixture's recorder (each launch checked against the manifest)

    def record(name, variant, device, sizes, pointers, stream=None):
        recorded(name, variant, device, sizes, pointers, stream)
        seen.append((name, variant.get("mode"), priority_of[CALLER if stream is None else stream]))

    def make_stream(device=None, priority=0):
        s = FakeStream(device, priority)
        priority_of[s.cuda_stream] = s.priority
        return s

    monkeypatch.setattr(torch.cuda, "Stream", make_stream)
    monkeypatch.setattr(launch, "_SIDE_STREAMS", {})
    monkeypatch.setattr(launch, "current_stream", lambda device: CALLER)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=CALLER))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: torch.cuda.StreamContext(None))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(settings, "save_chain_beside_dh", True)
    for mod in (fwd, bwd):
        monkeypatch.setattr(mod, "launch", record)
    return seen


def run_backward(lengths, hq=2, hv=4, K=128, V=128):
    T = sum(lengths)
    bf16 = torch.bfloat16
    q, k = torch.randn(1, T, hq, K).to(bf16), torch.randn(1, T, hq, K).to(bf16)
    v, g, beta = torch.randn(1, T, hv, V).to(bf16), -torch.rand(1, T, hv), torch.rand(1, T, hv)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    problem = validate_inputs(q, k, v, g, beta, None, None, cu)
    bwd.backward(problem, q, k, v, g, beta, None, cu, False, torch.randn_like(v), None)


@pytest.mark.parametrize("segment_chunks", [0, 4])  # no CP; intra-card CP
def test_save_build_above_the_dh_chains_priority(ops, monkeypatch, segment_chunks):
    monkeypatch.setattr(settings, "force_segment_chunks", segment_chunks)
    run_backward([700, 65, 1])
    (save,), (dh,) = ([p for n, m, p in ops if (n, m) == key] for key in
                      (("gdn_bwd_recompute", "save"), ("gdn_bwd_dh", "chain")))
    assert save < dh == 0  # a lower number is a higher priority in torch and CUDA
    assert all(p == 0 for n, _, p in ops if n != "gdn_bwd_recompute")
