"""pyproject's lower bounds on grpcio and protobuf admit no version that the generated code refuses at import.

qwenserve/v1/*_pb2.py call protobuf's ValidateProtobufRuntimeVersion (the runtime may not be older than
the protoc that generated them) and *_pb2_grpc.py raise when grpcio is older than GRPC_GENERATED_VERSION.
Regenerating with a newer grpcio-tools raises both; these tests fail until pyproject follows.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "qwenserve" / "v1"
# Released in lockstep with grpcio; each release needs the grpcio and protobuf of its own generation.
GRPC_FAMILY = ("grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-status")


def _protobuf_gencode_version(path: Path) -> Version:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "ValidateProtobufRuntimeVersion":
            major, minor, patch, suffix = (ast.literal_eval(a) for a in node.args[1:5])
            return Version(f"{major}.{minor}.{patch}{suffix}")
    raise AssertionError(f"{path.name} has no ValidateProtobufRuntimeVersion call")


def _grpc_generated_version(path: Path) -> Version:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "GRPC_GENERATED_VERSION"
                                                for t in node.targets):
            return Version(ast.literal_eval(node.value))
    raise AssertionError(f"{path.name} sets no GRPC_GENERATED_VERSION")


def _lower_bound(name: str) -> Version:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    requirement = next(r for r in map(Requirement, deps) if r.name == name)
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    assert bounds, f"{requirement} has no lower bound"
    return max(bounds)


def test_the_generated_code_is_found() -> None:
    assert len(list(GENERATED.glob("*_pb2.py"))) >= 6
    assert len(list(GENERATED.glob("*_pb2_grpc.py"))) == len(list(GENERATED.glob("*_pb2.py")))


def test_protobuf_lower_bound_is_at_least_the_gencode_version() -> None:
    needed = max(_protobuf_gencode_version(p) for p in GENERATED.glob("*_pb2.py"))
    assert _lower_bound("protobuf") >= needed, f'set "protobuf>={needed}" in pyproject.toml'


def test_grpcio_lower_bounds_are_at_least_the_generated_version() -> None:
    needed = max(_grpc_generated_version(p) for p in GENERATED.glob("*_pb2_grpc.py"))
    for name in GRPC_FAMILY:
        assert _lower_bound(name) >= needed, f'set "{name}>={needed}" in pyproject.toml'
