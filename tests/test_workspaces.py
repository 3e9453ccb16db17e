"""Canonical reduction workspaces (aot/kernels/workspaces.py) on CUDA text in the shape TileLang 0.1.15 generates (CPU
only: no TileLang needed)."""
from aot.kernels.workspaces import canonical_workspaces

DECLARATIONS = """extern "C" __global__ void demo_kernel(float* out) {
  extern __shared__ __align__(1024) uchar buf_dyn_shmem[];
  void* a_s = ((void*)((char*)buf_dyn_shmem + 0));
  void* workspace = ((void*)((char*)buf_dyn_shmem + 4096));
  void* workspace_1 = ((void*)((char*)buf_dyn_shmem + 12288));
  void* workspace_2 = ((void*)((char*)buf_dyn_shmem + 20480));
  void* workspace_3 = ((void*)((char*)buf_dyn_shmem + 22528));
  void* workspace_4 = ((void*)((char*)buf_dyn_shmem + 24576));
  void* b_s = ((void*)((char*)buf_dyn_shmem + 26624));
"""
USE = "  tl::AllReduce<tl::SumOp, 4, 1, 0, tl::NamedBarrier<256>, {batch}, 256>::run_batch((&({out}[0])), " \
      "(&(((float*)({ws}))[0])));\n"


def kernel(assignment):
    """The demo kernel whose reductions (out, batch) use the workspaces named in `assignment`, in code order."""
    body = "".join(USE.format(out=out, batch=batch, ws=ws) for (out, batch), ws in assignment)
    return DECLARATIONS + body + "}\n"


# two 8 KB workspaces (batch 8) and three 2 KB ones (batch 2): TileLang hands them out in a varying order
REDUCTIONS = [("r23", 2), ("cp", 8), ("dbc", 8), ("ra", 2), ("dbr", 2)]


def test_permutations_within_a_size_give_one_source():
    one = kernel(zip(REDUCTIONS, ["workspace_3", "workspace_1", "workspace", "workspace_4", "workspace_2"]))
    two = kernel(zip(REDUCTIONS, ["workspace_2", "workspace", "workspace_1", "workspace_3", "workspace_4"]))
    assert one != two
    canonical = canonical_workspaces(one)
    assert canonical == canonical_workspaces(two)
    # each size's workspaces in declaration order, taken by the reductions in code order
    assert canonical == kernel(zip(REDUCTIONS, ["workspace_2", "workspace", "workspace_1", "workspace_3",
                                                "workspace_4"]))
    assert canonical_workspaces(canonical) == canonical
    assert canonical.startswith(DECLARATIONS)  # the declarations are not renamed


def test_a_shared_workspace_stays_shared():
    shared = kernel(zip(REDUCTIONS[:4], ["workspace_4", "workspace_1", "workspace", "workspace_4"]))
    canonical = canonical_workspaces(shared)
    assert canonical == kernel(zip(REDUCTIONS[:4], ["workspace_2", "workspace", "workspace_1", "workspace_2"]))


def test_sources_out_of_shape_are_left_alone():
    plain = DECLARATIONS.replace("workspace", "scratch") + "}\n"
    assert canonical_workspaces(plain) == plain
    # the last buffer's size cannot be read off a next offset: nothing is renamed
    last = kernel(zip(REDUCTIONS[:2], ["workspace_4", "workspace_1"])).replace(
        "  void* b_s = ((void*)((char*)buf_dyn_shmem + 26624));\n", "")
    assert canonical_workspaces(last) == last
