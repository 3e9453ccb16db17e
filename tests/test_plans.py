"""Plan recording and replay (flash_qla/plans.py) on CPU tensors, with the C launcher's program calls stubbed: how a
call's pointers are traced to its buffers, when a recording cannot be replayed, the plan cache's bound and keys."""
from types import SimpleNamespace

import pytest
import torch

from flash_qla import kernel_api, plans
from flash_qla.tuning import override, settings
from flash_qla.validation import Problem


class StubNative:
    def __init__(self):
        self.programs, self.runs = [], []

    def program_new(self, op_list, nslots, nstreams):
        self.programs.append((op_list, nslots, nstreams))
        return len(self.programs) - 1

    def program_run(self, program, streams, pointers):
        self.runs.append((program, streams, pointers))


@pytest.fixture
def native(monkeypatch):
    stub = StubNative()
    monkeypatch.setattr("flash_qla.loader.native", lambda: stub)
    plans.clear()
    yield stub
    plans.clear()


KERNEL = SimpleNamespace(signature=b"pmi", block=(128, 1, 1), smem=0, key="k.test")
DEV = torch.device("cpu")


def test_pointers_trace_to_inputs_outputs_and_workspace(native):
    x = torch.zeros(64)
    rec = plans.Recorder([x, None], main_stream=7)
    out = torch.empty(10)
    rec.allocation(out, "o")
    ws1, ws2 = torch.empty(3), torch.empty(100)
    rec.allocation(ws1, None)
    rec.allocation(ws2, None)
    tmap = (9, 1, ws2.data_ptr() + 8, (100,), (), (32,), (1,), 0, 0, 0, 0)
    rec.launch(KERNEL, 0xF00, (1, 1, 1), 7, (x.data_ptr() + 16, tmap, 5))
    rec.launch(KERNEL, 0xF00, (2, 1, 1), 7, (out.data_ptr(), tmap, 6))
    plan = rec.plan([out], lambda o: o, DEV)
    ops_, nslots, nstreams = native.programs[0]
    assert (nslots, nstreams) == (4, 1)  # two inputs, one output, the workspace
    assert ops_[0][7][0] == (0, 16)
    assert ops_[0][7][1][2] == (3, plans.ALIGN + 8)  # ws2 follows ws1 at the next aligned offset
    assert ops_[1][7][0] == (2, 0) and ops_[1][2] == (2, 1, 1)
    assert plan.workspace == plans.ALIGN + 512 and plan.outputs == (((10,), torch.float32),)
    assert plan.results[0].whole


def test_untraceable_pointer_or_overlapping_inputs_are_not_replayed(native):
    x = torch.zeros(64)
    rec = plans.Recorder([x], main_stream=1)
    rec.launch(KERNEL, 1, (1, 1, 1), 1, (12345678, (9, 1, 0, (1,), (), (1,), (1,), 0, 0, 0, 0), 0))
    with pytest.raises(plans._Unreplayable, match="lies in no input"):
        rec.plan([], lambda: None, DEV)
    rec = plans.Recorder([x, x[8:]], main_stream=1)  # one buffer passed twice
    with pytest.raises(plans._Unreplayable, match="overlaps"):
        rec.plan([], lambda: None, DEV)
    rec = plans.Recorder([x], main_stream=1)
    rec.join(2, 1)  # a stream that is neither the caller's nor a named side stream
    with pytest.raises(plans._Unreplayable, match="stream"):
        rec.plan([], lambda: None, DEV)


def _recorded_call(x, calls):
    """A call as the kernel path makes one: an output allocation and a launch reading x, seen by the recorder."""
    def record():
        calls.append(1)
        out = torch.empty(4)
        rec = plans.recorder()
        if rec is not None:
            rec.allocation(out, "o")
            rec.launch(KERNEL, 1, (1, 1, 1), 0, (x.data_ptr(), (9, 1, None, (1,), (), (1,), (1,), 0, 0, 0, 0), 3))
        return (out,), lambda o: o
    return record


def test_call_records_once_then_replays(native):
    x = torch.ones(8)
    calls = []
    for _ in range(3):
        plans.call(("k", 1), (x,), DEV, 0, _recorded_call(x, calls), None)
    assert len(calls) == 1 and len(native.runs) == 2
    assert native.runs[-1][2] == (x.data_ptr(), native.runs[-1][2][1], 0)  # input, output, no workspace
    assert plans.stats()["recorded"] == 1 and plans.stats()["replayed"] == 2
    with override(replay=False):  # as written: records nothing, replays nothing
        plans.call(("k", 1), (x,), DEV, 0, _recorded_call(x, calls), None)
    assert len(calls) == 2 and len(native.runs) == 2


def test_plan_cache_is_bounded(native):
    x = torch.ones(8)
    with override(plan_cache_size=3):
        for i in range(10):
            plans.call(("k", i), (x,), DEV, 0, _recorded_call(x, []), None)
        assert plans.stats()["cached"] == 3 and plans.stats()["evicted"] == 7


def test_tuning_changes_bump_the_generation_and_reject_unknown_settings():
    before = settings.generation
    with override(force_block_v=64):
        assert settings.generation == before + 1
    assert settings.generation == before + 2 and settings.force_block_v is None
    with pytest.raises(AttributeError, match="no setting"):
        settings.force_blockv = 64
    for bad in (0, -3, 1.5):  # a grid cap the kernels could not launch with
        with pytest.raises(ValueError, match="fused_ctas_max must be a positive int"):
            settings.fused_ctas_max = bad
    assert settings.fused_ctas_max is None


def _problem(**changes):
    base = dict(batch=1, tokens=1000, num_qk_heads=4, num_v_heads=8, head_dim_k=128, head_dim_v=128, num_seqs=2,
                scale=128 ** -0.5, varlen=True)
    return Problem(**dict(base, **changes))


@pytest.mark.parametrize("change", [
    dict(problem=_problem(tokens=1001)), dict(problem=_problem(num_seqs=3)), dict(problem=_problem(num_v_heads=16)),
    dict(problem=_problem(num_qk_heads=8)), dict(problem=_problem(head_dim_v=64)), dict(problem=_problem(scale=0.1)),
    dict(dtype=torch.float16), dict(use_qk_l2norm=True), dict(device=torch.device("cuda", 1)),
    dict(has_h0=False), dict(output_final_state=False), dict(want_gate_free_inverse=True)])
def test_forward_keys_differ_in_what_plans_depend_on(change):
    base = dict(problem=_problem(), device=torch.device("cuda", 0), dtype=torch.bfloat16, has_h0=True,
                output_final_state=True, use_qk_l2norm=False, want_gate_free_inverse=False)
    assert kernel_api.forward_key(**base) == kernel_api.forward_key(**base)
    assert kernel_api.forward_key(**base) != kernel_api.forward_key(**dict(base, **change))


def test_a_buffer_the_call_freed_and_the_allocator_reused_names_the_new_allocation(native):
    x = torch.zeros(16)
    rec = plans.Recorder([x], main_stream=0)
    first = torch.empty(64)
    rec.allocation(first, None)
    address = first.data_ptr()
    rec.launch(KERNEL, 1, (1, 1, 1), 0, (address, (9, 1, None, (1,), (), (1,), (1,), 0, 0, 0, 0), 0))
    # a second buffer at the same address, as the caching allocator hands out freed memory
    rec._add(address, 256, -1, rec.workspace, "workspace")
    rec.workspace += 256
    rec.launch(KERNEL, 1, (1, 1, 1), 0, (address, (9, 1, None, (1,), (), (1,), (1,), 0, 0, 0, 0), 0))
    rec.plan([], lambda: None, DEV)
    ops_ = native.programs[0][0]
    assert ops_[0][7][0] == (1, 0) and ops_[1][7][0] == (1, 256)  # each launch kept the buffer it saw (slot 1: the workspace)


def test_a_failed_replay_names_the_kernel(native, monkeypatch):
    from flash_qla.errors import CudaDriverError
    x = torch.ones(8)
    plans.call(("k", 9), (x,), DEV, 0, _recorded_call(x, []), None)  # recorded

    def fail(program, streams, pointers):
        raise CudaDriverError("program op 0: cuLaunchKernel(grid (1, 1, 1), block (128, 1, 1), smem 0) failed", 1,
                              "CUDA_ERROR_INVALID_VALUE", "invalid argument")
    monkeypatch.setattr(native, "program_run", fail)
    with pytest.raises(CudaDriverError, match=r"kernel k\.test on cpu: program op 0: cuLaunchKernel") as e:
        plans.call(("k", 9), (x,), DEV, 0, _recorded_call(x, []), None)
    assert e.value.name == "CUDA_ERROR_INVALID_VALUE"
