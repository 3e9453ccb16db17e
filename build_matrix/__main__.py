"""python -m build_matrix {build,check,list}"""
import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m build_matrix", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile stale variants into flash_qla/_kernels/sm90a")
    b.add_argument("--subset", choices=["smoke", "full"], default="full")
    b.add_argument("--jobs", type=int, default=0, help="parallel compiles (default: CPU count)")
    b.add_argument("--force", action="store_true", help="ignore the cache")
    b.add_argument("--only", action="append", default=[], metavar="SUBSTRING",
                   help="compile only stale variants whose key contains SUBSTRING (repeatable): a kernel A/B "
                        "build; the others stay stale until a full build, and `check` says so")
    sub.add_parser("check", help="fail if a committed cubin is stale or missing")
    sub.add_parser("list", help="list the variant matrix")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        from .build import main as build_main
        return build_main(args.subset, args.jobs, args.force, args.only)
    if args.cmd == "check":
        from .check import main as check_main
        return check_main()
    from .variants import all_variants
    for v in all_variants("full"):
        print(v.key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
