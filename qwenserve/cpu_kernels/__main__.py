"""`python -m qwenserve.cpu_kernels build [--dir DIR]`: build every instruction-set variant of the CPU kernels
at install or image-build time, so that no pod compiles them; `... status` says which one this CPU would load."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from qwenserve.cpu_kernels import builder, loader


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwenserve.cpu_kernels", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build every variant for this architecture")
    build.add_argument("--dir", type=Path, default=None,
                       help=f"where to write them (default: ${builder.ENV_DIR} or {builder.kernel_dir()})")
    build.add_argument("--force", action="store_true",
                       help="build them again even where one of these sources is there")
    commands.add_parser("status", help="which variant this CPU loads, or why none")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.command == "build":
        variants = builder.machine_variants()
        built = builder.build_variants(args.dir, force=args.force)
        for path in built:
            print(f"built {path}")
        if len(built) < len(variants):
            print(f"built {len(built)} of {len(variants)} variants (see the warnings above)", file=sys.stderr)
            return 1
        return 0
    kernels = loader.load()
    print(f"CPU kernels: {kernels.variant}" if kernels else "CPU kernels: unavailable")
    return 0 if kernels else 1


if __name__ == "__main__":
    sys.exit(main())
