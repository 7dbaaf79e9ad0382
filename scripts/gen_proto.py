"""Generate the Python gRPC code for proto/qwenserve/v1/*.proto into qwenserve/v1/.

Run as `make proto`. `--check` regenerates into a temporary folder and exits non-zero when the
committed files differ, which is what the staleness test uses.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = "qwenserve/v1"


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto under proto/qwenserve/v1 into out_dir; return the generated files."""
    protos = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    pkg = out_dir / PACKAGE
    (pkg / "__init__.py").write_text('"""Generated gRPC code for the qwenserve.v1 contracts (make proto)."""\n')
    return sorted(p for p in pkg.iterdir() if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            p.name for p in fresh if not (ROOT / PACKAGE / p.name).exists()
            or not filecmp.cmp(p, ROOT / PACKAGE / p.name, shallow=False)
        ]
        committed = {p.name for p in (ROOT / PACKAGE).iterdir() if p.is_file() and p.suffix in (".py", ".pyi")}
        extra = sorted(committed - {p.name for p in fresh})
    if stale or extra:
        print(f"generated code is stale: {stale + extra}; run `make proto`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
