"""Generates the Python gRPC code for ``protos/`` into ``psproto/`` (the single codegen entry point).

Run ``python scripts/gen_protos.py`` after editing a ``.proto``; ``pip install .``
runs it through the hatch build hook (``hatch_build.py``). The output is
git-ignored and never committed.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Runs protoc over every ``.proto`` under ``protos/`` and returns the generated files."""
    from grpc_tools import protoc  # build-time dependency only

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    include = str(pathlib.Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed: " + " ".join(args))
    generated: list[pathlib.Path] = []
    for proto in protos:
        package_dir = out_dir / proto.parent.relative_to(PROTO_ROOT)
        # Every directory from psproto/ down is a regular package.
        for d in [package_dir, *package_dir.parents]:
            if d == out_dir or out_dir not in d.parents:
                continue
            init = d / "__init__.py"
            if not init.exists():
                init.write_text('"""Generated from protos/ by scripts/gen_protos.py; do not edit."""\n')
            generated.append(init)
        stem = proto.stem
        generated += [
            package_dir / f"{stem}_pb2.py",
            package_dir / f"{stem}_pb2.pyi",
            package_dir / f"{stem}_pb2_grpc.py",
        ]
    return sorted(set(generated))


if __name__ == "__main__":
    for path in generate():
        sys.stdout.write(f"{path.relative_to(ROOT)}\n")
