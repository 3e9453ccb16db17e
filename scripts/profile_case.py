"""Run one benchmark row's call a few times, for ncu / nsys on the GPU machine.

usage: python scripts/profile_case.py ROW [--pass fwd|bwd] [--calls N] [--l2norm]
ROW: a substring of the row key, e.g. "TP1-397B|4096x8" or "hk16_hv32|32k_8seq" (the first matching row is run).
--l2norm: the forward with use_qk_l2norm_in_kernel=True. The library's own switches apply (FLASH_QLA_FUSED=0/1 pins
the forward path). Example:
    ncu --set full -k regex:gdn_fwd_fused -c 1 -o prof python scripts/profile_case.py "TP8|1x32768"
"""
import argparse

import torch

from flash_qla.bench.workloads import backward_rows, forward_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("row")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="fwd")
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--l2norm", action="store_true", help="the forward with use_qk_l2norm_in_kernel=True")
    args = p.parse_args()
    if args.l2norm and args.pass_ != "fwd":
        raise SystemExit("profile_case: --l2norm is the forward's (the backward rows are the low-level backward's)")
    rows = forward_rows([args.row], l2norm=args.l2norm) if args.pass_ == "fwd" else backward_rows([args.row])
    found = next(rows, None)
    if found is None:
        raise SystemExit(f"profile_case: no {args.pass_} row matches {args.row!r}")
    row, _, call = found
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(f"profile_case: {row.key}, {args.calls} calls")


if __name__ == "__main__":
    main()
