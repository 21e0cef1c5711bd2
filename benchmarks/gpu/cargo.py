"""What a GPU machine lacks, carried in calls of at most 64 MiB: our code's wheels and the default model's GGUF.

``python -m benchmarks.gpu.cargo prepare`` (here, where pip reaches PyPI) downloads, for the machine's Python 3.12,
the wheels of every package our serving and training paths import that its image lacks or has too old (transformers
5.17 there; our batched engine needs 5.24), at the versions installed here, and cuts the GGUF into pieces; it packs
both into folders ``.gpu/cargo/01``, ``02``, ... each small enough to travel beside the working tree in one call
(whose own size decides how many calls it takes: with the shipped drafter and corpus tracked, about 47 MiB of the
64 travel every call), and writes the calls to make in ``.gpu/cargo/plan.txt``.

``python -m benchmarks.gpu.cargo unpack .gpu/cargo/NN`` (there, one call per folder, each right after the other:
the machine keeps what an earlier call left in the working tree only while it stays warm) installs that folder's
wheels into ``.gpu/store/site`` and keeps its GGUF pieces; once the last piece is there, the GGUF is put together and
its sha256 checked. Scripts then run with ``PYTHONPATH=.gpu/store/site``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARGO = ROOT / ".gpu" / "cargo"
STORE = ROOT / ".gpu" / "store"
ROOM = 64 * 2**20
"""What one call may send, the working tree included."""
MARGIN = 2 * 2**20
WHEELS = (
    "transformers",
    "tokenizers",
    "huggingface-hub",
    "gguf",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "llguidance",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
)
"""Distributions the GPU image lacks or holds too old a version of (its package list: the device tool's KINDS.md)."""
PLATFORMS = (
    "manylinux1_x86_64",
    "manylinux2014_x86_64",
    *(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)),
)
"""pip matches a platform tag exactly: every glibc a wheel here is built for, up to the machine's."""
PLAN = "plan.json"


def file_sha256(path: Path) -> str:
    """The file's digest, by the standard library alone: ``unpack`` runs before our packages' needs are installed
    (``backends`` imports pydantic, which the machine's image lacks)."""
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for chunk in iter(lambda: data.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tree_bytes() -> int:
    """Bytes of what travels with every call: tracked files, and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def download_wheels(folder: Path) -> list[Path]:
    """Each of :data:`WHEELS` at the version installed here, for CPython 3.12 on x86-64 Linux."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    command += ["--implementation", "cp", "-d", str(folder)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run([*command, *(f"{name}=={version(name)}" for name in WHEELS)], check=True)
    return sorted(folder.glob("*.whl"))


def pack(wheels: list[Path], gguf: Path, room: int, out: Path) -> list[Path]:
    """Folders ``out/01``, ``out/02``, ... of at most ``room`` bytes each: the wheels whole, then the GGUF in pieces;
    each holds the plan, so any of them tells how many pieces make the file."""
    if out.exists():
        shutil.rmtree(out)
    folders: list[list[tuple[str, Path | tuple[int, int]]]] = [[]]
    used = 0
    for wheel in wheels:
        size = wheel.stat().st_size
        if size > room:
            raise SystemExit(f"{wheel.name} ({size / 2**20:.1f} MiB) is larger than a call's room")
        if used + size > room:
            folders.append([])
            used = 0
        folders[-1].append((wheel.name, wheel))
        used += size
    total, offset, pieces = gguf.stat().st_size, 0, 0
    while offset < total:
        if used >= room:
            folders.append([])
            used = 0
        length = min(room - used, total - offset)
        folders[-1].append((f"{gguf.name}.part{pieces:02d}", (offset, length)))
        offset, used, pieces = offset + length, used + length, pieces + 1
    plan = {"gguf": gguf.name, "sha256": file_sha256(gguf), "pieces": pieces, "folders": len(folders)}
    written = []
    with gguf.open("rb") as source:
        for index, contents in enumerate(folders, start=1):
            folder = out / f"{index:02d}"
            folder.mkdir(parents=True)
            for name, what in contents:
                if isinstance(what, Path):
                    shutil.copy2(what, folder / name)
                else:
                    source.seek(what[0])
                    (folder / name).write_bytes(source.read(what[1]))
            (folder / PLAN).write_text(json.dumps(plan) + "\n")
            written.append(folder)
    return written


def unpack(folder: Path, store: Path = STORE) -> dict:
    """One cargo folder into the store: its wheels installed, its GGUF pieces kept, the GGUF put together and
    checked once every piece is there. What the store holds now."""
    plan = json.loads((folder / PLAN).read_text())
    (store / "pieces").mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob("*.whl"))
    if wheels:
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*command, "--upgrade", "--target", str(store / "site"), *map(str, wheels)], check=True)
    for piece in folder.glob(f"{plan['gguf']}.part*"):
        shutil.copy2(piece, store / "pieces" / piece.name)
    pieces = sorted((store / "pieces").glob(f"{plan['gguf']}.part*"))
    gguf = store / plan["gguf"]
    if len(pieces) == plan["pieces"]:
        with gguf.open("wb") as whole:
            for piece in pieces:
                whole.write(piece.read_bytes())
        if file_sha256(gguf) != plan["sha256"]:
            gguf.unlink()
            raise SystemExit(f"{plan['gguf']} put together has the wrong sha256: a piece is missing or damaged")
        shutil.rmtree(store / "pieces")
    return {"pieces": len(pieces), "of": plan["pieces"], "gguf": gguf.is_file(), "wheels": len(wheels)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.cargo", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    prepare = verbs.add_parser("prepare", help="wheels and the GGUF, in folders of one call each (here)")
    prepare.add_argument("--gguf", type=Path, help="the model file (default: the default model's, from its wheel)")
    prepare.add_argument("--out", type=Path, default=CARGO)
    verbs.add_parser("unpack", help="one cargo folder into .gpu/store (there)").add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.verb == "unpack":
        print(json.dumps(unpack(args.folder)))
        return 0
    from backends.convert import packaged_gguf

    room = ROOM - tree_bytes() - MARGIN
    folders = pack(download_wheels(ROOT / ".gpu" / "wheels"), args.gguf or packaged_gguf(), room, args.out)
    calls = [
        f'run(command="python3 -m benchmarks.gpu.cargo unpack {f.relative_to(ROOT)}", carry=["{f.relative_to(ROOT)}"])'
        for f in folders
    ]
    (args.out / "plan.txt").write_text("\n".join(calls) + "\n")
    print(f"{len(folders)} calls of at most {room / 2**20:.1f} MiB beside the {tree_bytes() / 2**20:.1f} MiB tree:")
    print("\n".join(calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
