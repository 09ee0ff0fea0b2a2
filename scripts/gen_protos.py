"""Generates the Python stubs for every .proto under protos/ (the only way they are made).

Run `python scripts/gen_protos.py` after editing a .proto; `--check` regenerates into a
temporary folder and fails when the committed stubs differ (CI runs it), so stubs never
drift from their sources. Stubs are written beside the .proto files, so the folder tree
mirrors the package: protos/ballast/v1/x.proto -> ballast.v1.x_pb2.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    protos = [str(p.relative_to(PROTO_ROOT)) for p in _proto_files()]
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Each folder of generated stubs is a package.
    for proto in protos:
        package_dir = out_dir / Path(proto).parent
        while package_dir != out_dir:
            init = package_dir / "__init__.py"
            if not init.exists():
                init.write_text('"""Generated protobuf stubs; see scripts/gen_protos.py."""\n')
            package_dir = package_dir.parent


def _generated_files(base: Path) -> list[Path]:
    return sorted(
        p.relative_to(base)
        for p in base.rglob("*")
        if p.is_file() and (p.name.endswith(GENERATED_SUFFIXES) or p.name == "__init__.py")
    )


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        expected = _generated_files(fresh)
        committed = _generated_files(PROTO_ROOT)
        stale = [
            str(p) for p in expected if p not in committed or not filecmp.cmp(fresh / p, PROTO_ROOT / p, shallow=False)
        ]
        extra = [str(p) for p in committed if p not in expected]
        if stale or extra:
            print("generated stubs are stale; run: python scripts/gen_protos.py", file=sys.stderr)
            for name in stale + extra:
                print(f"  {name}", file=sys.stderr)
            return 1
    print(f"stubs up to date ({len(expected)} files)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args()
    if args.check:
        return check()
    for stale in _generated_files(PROTO_ROOT):
        if stale.name != "__init__.py":
            (PROTO_ROOT / stale).unlink()
    generate(PROTO_ROOT)
    print("generated stubs under protos/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
