"""Regenerate the Python gRPC code from tokq/v1/embedder.proto (`make proto`).

`generate(out_dir)` writes into any directory so the drift test can compare a fresh build with
the committed files.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO = "tokq/v1/embedder.proto"
GENERATED = ("embedder_pb2.py", "embedder_pb2.pyi", "embedder_pb2_grpc.py")
ROOT = Path(__file__).resolve().parents[2]


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out_dir / "tokq" / "v1" / name for name in GENERATED]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = ROOT / "tokq" / "v1" / path.name
            target.write_bytes(path.read_bytes())
            print(f"wrote {target.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
