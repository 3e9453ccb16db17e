"""The API's fast lane (flash_qla.api._FAST): a repeated plain call skips the checks, so the signature must cover
everything they read, and only plain calls may take it."""
import pytest
import torch

import flash_qla
from flash_qla import api
from flash_qla.tuning import override


def inputs(T=6, hq=1, hv=2, K=4, V=4, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, T, hq, K, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(1, T, hv, V, generator=gen, dtype=dtype)
    g = -torch.rand(1, T, hv, generator=gen)
    beta = torch.rand(1, T, hv, generator=gen)
    cu = torch.tensor([0, 2, T], dtype=torch.int32)
    return q, k, v, g, beta, cu


def sig(q, k, v, g, beta, cu, scale=None, h0=None, final=True, l2=False, chunk=64):
    return api._signature(q, k, v, g, beta, scale, h0, cu, final, l2, chunk)


CHANGES = {
    "tokens": lambda a: inputs(T=7),
    "heads": lambda a: inputs(hq=2, hv=2),
    "dtype": lambda a: inputs(dtype=torch.float64),
    "g dtype": lambda a: a[:3] + (a[3].half(),) + a[4:],
    "non-contiguous v": lambda a: a[:2] + (a[2].transpose(2, 3).contiguous().transpose(2, 3),) + a[3:],
    "cu dtype": lambda a: a[:5] + (a[5].long(),),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_signatures_differ_in_what_the_checks_read(change):
    a = inputs()
    assert sig(*a) == sig(*inputs())
    assert sig(*a) != sig(*CHANGES[change](a))


def test_signatures_differ_in_scale_type_flags_state_and_tuning():
    a = inputs()
    base = sig(*a)
    h0 = torch.zeros(2, 2, 4, 4)
    others = [sig(*a, scale=1), sig(*a, scale=1.0), sig(*a, h0=h0), sig(*a, h0=h0.transpose(2, 3)),
              sig(*a, final=False), sig(*a, l2=True), sig(*a, chunk=32),
              api._signature(*a[:5], None, None, a[5], True, False, 64, None, False)]   # auto_cp=False
    assert len({base, *others}) == 1 + len(others)
    with override(poison_outputs=True):
        assert sig(*a) != base
    assert sig(object(), *a[1:]) is None  # not a tensor: the full path names the problem


def test_only_cuda_calls_in_the_kernels_layouts_are_eligible():
    q, k, v, g, beta, cu = inputs()
    assert not api._fast_eligible(q, k, v, g, beta, None, cu, "auto")  # CPU tensors run the reference


class _Recorded:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return "fast lane"


@pytest.fixture
def planted(monkeypatch):
    """A fast-lane entry for these CPU inputs' plain signature (CPU calls never register one themselves)."""
    monkeypatch.setattr(api, "_FAST", {})
    a = inputs()
    entry = _Recorded()
    api._FAST[sig(*a)] = entry
    return a, entry


def test_a_plain_repeat_takes_the_fast_lane(planted):
    (q, k, v, g, beta, cu), entry = planted
    assert flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu) == "fast lane"
    assert entry.calls == 1


def test_auto_cp_false_has_a_fast_lane_of_its_own(planted):
    # FlashQLA's auto_cp=False plans without intra-card CP: a plain call, under its own signature
    (q, k, v, g, beta, cu), entry = planted
    no_cp = _Recorded()
    api._FAST[api._signature(q, k, v, g, beta, None, None, cu, True, False, 64, None, False)] = no_cp
    assert flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                            auto_cp=False) == "fast lane"
    assert no_cp.calls == 1 and entry.calls == 0


@pytest.mark.parametrize("extra, error", [
    (dict(output_final_state=1), TypeError),            # a non-bool flag is named, not matched as True
    (dict(backend="bogus"), ValueError),
    (dict(auto_cp="yes"), TypeError),
    (dict(head_first=True), ValueError),
    (dict(allow_neg_eigval=True), ValueError),
])
def test_calls_that_are_not_plain_never_take_the_fast_lane(planted, extra, error):
    (q, k, v, g, beta, cu), entry = planted
    kw = dict(dict(output_final_state=True), **extra)
    with pytest.raises(error):
        flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, **kw)
    assert entry.calls == 0


def test_keyword_calls_with_other_meanings_take_the_full_path(planted):
    (q, k, v, g, beta, cu), entry = planted
    h0 = torch.zeros(2, 2, 4, 4)
    o, ht = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                             initial_state=h0, state_v_first=True)
    assert entry.calls == 0 and ht.shape == (2, 2, 4, 4)


def test_the_table_is_bounded(monkeypatch):
    monkeypatch.setattr(api, "_FAST", {})
    monkeypatch.setattr(api, "_FAST_MAX", 4)
    for i in range(10):
        api._remember(("sig", i), i)
    assert len(api._FAST) == 4 and ("sig", 9) in api._FAST and ("sig", 0) not in api._FAST


def test_host_offsets_are_checked_on_the_fast_lane():
    from flash_qla.validation import host_lengths
    assert host_lengths(torch.tensor([0, 2, 7, 9]), 9) == (5, True)    # a longer sequence after a shorter one
    assert host_lengths(torch.tensor([0, 5, 7, 9]), 9) == (5, False)   # longest first
    assert host_lengths(torch.tensor([0, 5, 6, 9]), 9) == (5, True)    # 5, 1, 3
    assert host_lengths(torch.tensor([0, 3, 6, 9]), 9) == (3, False)   # equal lengths
    assert host_lengths(torch.tensor([0, 9]), 9) is None
    for bad, msg in (([0, 5, 3, 9], "non-decreasing"), ([1, 5, 9], "start at 0"), ([0, 5, 8], "end at the token")):
        with pytest.raises(ValueError, match=msg):
            host_lengths(torch.tensor(bad), 9)


def test_signatures_tell_host_offsets_apart():
    a = inputs()
    cu = a[5]
    assert api._signature(*a[:5], None, None, cu, True, False, 64, cu) != sig(*a)
    assert api._signature(*a[:5], None, None, cu, True, False, 64, cu.long()) != \
        api._signature(*a[:5], None, None, cu, True, False, 64, cu)
