"""The forward planner on batches of short sequences (scripts/short_batch_sweep.py plans: every plan timed on the
H100 on 16 to 512 sequences of 8 to 64 tokens at the standard head configurations), and the persistent fused
kernel's CTA count the planner models."""
import json
import re

import pytest
from conftest import repo_text

from flash_qla import cp
from flash_qla.planner import FUSED_PERSISTENT_CTAS, plan_forward



def test_persistent_cta_count_matches_the_kernel():
    src = repo_text("aot", "kernels", "gdn_fwd_fused.py")
    found = re.search(r"^PERSISTENT_CTAS = (\d+)", src, re.M)
    assert found and int(found.group(1)) == FUSED_PERSISTENT_CTAS


def _measured(row, plan):
    name = f"fused_bv{plan.block_v}" if plan.path == "fused" else f"split_bv{plan.block_v}_hpc{plan.heads_per_cta}"
    return row["candidates"][name]


def test_short_batch_plans_against_the_committed_sweep():
    """The plan chosen for each shape costs its measured time: within 3% of the best measured plan on at least 90%
    of the 64 shapes, never 1.25x."""
    ratios = []
    for line in repo_text("bench", "results", "h100", "plan_sweep_short.jsonl").splitlines():
        row = json.loads(line)
        plan = plan_forward(row["tokens"], row["seqs"], row["hv"], row["hq"], 128, 132, (64, 128), (64, 128),
                            cp.SEGMENT_CHUNKS)
        ratios.append((_measured(row, plan) / min(row["candidates"].values()), row["shape"]))
    assert len(ratios) == 64
    close = sum(r <= 1.03 for r, _ in ratios) / len(ratios)
    assert close >= 0.9 and max(ratios)[0] < 1.25, (close, sorted(ratios)[-4:])


@pytest.mark.parametrize("tokens", [8, 64])
def test_many_short_sequences_without_gqa_take_the_persistent_fused_kernel(tokens):
    # 2B-TP1 (16 / 16 heads), 512 sequences: gdn_prepare's one head per CTA costs more than the fused kernel's
    # streamed items (H100: fused 0.608 / 0.730 ms, prepare + chain 0.639 / 0.885 at 8 / 64 tokens)
    plan = plan_forward(512 * tokens, 512, 16, 16, 128, 132, (64, 128), (64, 128), cp.SEGMENT_CHUNKS)
    assert (plan.path, plan.block_v) == ("fused", 128)


@pytest.mark.parametrize("seqs,tokens,hv,want", [
    (64, 8, 8, 132),      # 512 one-chunk items: one CTA an SM walks them
    (16, 64, 64, 132),    # 1024 items, full chunks
    (256, 64, 64, None),  # 16384 items: the 528-CTA grid
    (8, 1024, 64, None),  # multi-chunk sequences
])
def test_one_chunk_batches_run_one_cta_an_sm(seqs, tokens, hv, want):
    plan = plan_forward(seqs * tokens, seqs, hv, hv // 4, 128, 132, (64, 128), (64, 128), cp.SEGMENT_CHUNKS,
                        path="fused")
    assert plan.fused_ctas == want
