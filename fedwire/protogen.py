"""Regenerate the committed gRPC stubs from ``proto/``: ``python -m fedwire.protogen``.

Every ``proto/**/*.proto`` is compiled with the protoc bundled in ``grpcio-tools`` (so the
output depends only on the pinned grpcio-tools version, not on a system protoc):
``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py``. The proto package stays ``fedatoms.v1``
(its descriptor name and service names are the wire contract), but its Python stubs live in
this bottom package, ``fedwire.v1``, so server, client and dashboard import them downward:
protoc names the stub modules after the proto path, so ``fedatoms/v1/`` is written as
``fedwire/v1/`` and the one absolute import protoc writes (``from fedatoms.v1 import …``) is
rewritten to match. ``tests/test_proto.py`` regenerates into a temporary directory and fails
when the committed files differ.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

__all__ = ["PROTO_ROOT", "REPO_ROOT", "generate", "main", "proto_files", "stub_names"]

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
_STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
#: The proto package's directory and the Python package its stubs are written to.
PROTO_PACKAGE, STUB_PACKAGE = "fedatoms", "fedwire"


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every ``.proto`` under ``proto_root``, relative to it, in a stable order."""
    if not proto_root.is_dir():
        raise FileNotFoundError(
            f"no proto directory at {proto_root}: regenerate the stubs from a source checkout of fedatoms"
        )
    return sorted(p.relative_to(proto_root) for p in proto_root.rglob("*.proto"))


def stub_names(proto: Path) -> list[Path]:
    """The stub paths (relative to the output directory) protoc writes for one ``.proto`` path."""
    stem = proto.with_suffix("")
    return [stem.parent / f"{stem.name}{suffix}" for suffix in _STUB_SUFFIXES]


def _stub_path(protoc_path: Path) -> Path:
    """Where a stub protoc wrote under the proto package's directory lives in :data:`STUB_PACKAGE`."""
    parts = protoc_path.parts
    if parts and parts[0] == PROTO_PACKAGE:
        return Path(STUB_PACKAGE, *parts[1:])
    return protoc_path


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every proto under ``proto_root`` into ``out_dir``; return the files written.

    Raises
    ------
    RuntimeError
        When protoc fails (its diagnostics are on stderr).
    """
    import tempfile

    from grpc_tools import protoc  # imported here: only needed when regenerating

    protos = proto_files(proto_root)
    if not protos:
        raise FileNotFoundError(f"no .proto files under {proto_root}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as raw:
        raw_dir = Path(raw)
        _protoc(protoc, raw_dir, proto_root, protos)
        written = []
        for p in protos:
            for stub in stub_names(p):
                source = raw_dir / stub
                if not source.is_file():
                    raise RuntimeError(f"protoc did not write {stub}")
                text = source.read_text().replace(f"from {PROTO_PACKAGE}.", f"from {STUB_PACKAGE}.")
                target = out_dir / _stub_path(stub)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
                written.append(target)
    return written


def _protoc(protoc, out_dir: Path, proto_root: Path, protos: list[Path]) -> None:  # type: ignore[no-untyped-def]
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",  # argv[0], ignored
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(proto_root / p) for p in protos),
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with exit status {status} on {', '.join(map(str, protos))}")


def main(argv: list[str] | None = None) -> int:
    """Regenerate the stubs in place (into the repository root) and list them."""
    if argv:
        print("usage: python -m fedwire.protogen  (no arguments)", file=sys.stderr)
        return 2
    for path in generate(REPO_ROOT):
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
