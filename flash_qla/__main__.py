"""``python -m flash_qla <command>``. Commands: ``info`` (default) - see :mod:`flash_qla.info`."""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and not argv[0].startswith("-") else "info"
    if cmd == "info":
        from .info import main as info_main
        return info_main(argv)
    print(f"usage: python -m flash_qla info [--json] [--device N] [--no-load] [--kernels DIR]\n"
          f"unknown command {cmd!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
