"""scripts/plan_fit.py: the fused kernel's planner constants recovered from sweep rows made by the model itself."""
import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("plan_fit", ROOT / "scripts" / "plan_fit.py")
plan_fit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan_fit)

SMS = 132


def _row(hv, seqs, tokens, ms, bv=64):
    return {"set": "grid", "shape": f"hv{hv}|{seqs}x{tokens // seqs}", "hq": hv // 2, "hv": hv, "tokens": tokens,
            "seqs": seqs, "equal_lengths": True, "l2norm": False, "candidates": {f"fused_bv{bv}": ms}}


def test_chain_fit_recovers_per_chunk_and_per_chain():
    c, f = 2.5, 7.0
    rows = []
    for hv in (4, 8, 32, 64):
        for seqs, tokens in ((1, 4096), (1, 32768), (4, 16384), (2, 2048)):
            items = seqs * hv * 2
            if items > plan_fit.FUSED_PERSISTENT_CTAS:
                continue
            rounds, chunks = math.ceil(items / SMS), math.ceil(tokens / seqs / 64)
            rows.append(_row(hv, seqs, tokens, rounds * (chunks * c + f) / 1000))
    samples = plan_fit.fused_samples(rows, 64, SMS)
    (got_c, got_f), worst = plan_fit.fit(samples)
    assert got_c == pytest.approx(c, rel=1e-9) and got_f == pytest.approx(f, rel=1e-9) and worst < 1e-9


def test_stream_fit_takes_one_chunk_batches_past_the_persistent_limit():
    a, b, ramp = 5.0, 0.5, 4.0
    rows = []
    for hv in (16, 32, 64):
        for seqs in (64, 256, 512):
            for t in (8, 32, 64):
                items = seqs * hv * 2
                if items <= plan_fit.FUSED_PERSISTENT_CTAS:
                    continue
                rounds = math.ceil(items / SMS)
                ramps = math.ceil(min(items, plan_fit.FUSED_PERSISTENT_CTAS) / SMS)
                rows.append(_row(hv, seqs, seqs * t, (rounds * (a + b * t / 64) + ramps * ramp) / 1000))
    rows.append(_row(64, 512, 512 * 128, 1.0))  # two chunks a sequence: not the streaming fit's
    samples = plan_fit.stream_samples(rows, 64, SMS)
    assert len(samples) == len(rows) - 1
    (got_a, got_b, got_ramp), worst = plan_fit.fit(samples)
    assert (got_a, got_b, got_ramp) == pytest.approx((a, b, ramp), rel=1e-6) and worst < 1e-6
