"""Compile the gateway's per-call modules with mypyc (run by `make native`).

The list is `qosgate.native.MODULES`; the extension modules land next to their source
(git ignores them) with the mypyc runtime in one shared library, `qosgate/_native__mypyc`,
and `qosgate/native.sha256` records the SHA-256 of each source as compiled (importing
qosgate compares it with the source it finds). Each build starts from scratch: the old
extension modules are removed first, so a module taken off the list runs interpreted again.

gcc takes a minute and a half over mypyc's C, so what a build produced is kept in a cache,
`$XDG_CACHE_HOME/qosgate/native/` (default `~/.cache`; the last 8 builds), under the
SHA-256 of everything the output depends on: every source and stub of the package (the
compiled modules' code depends on the types of those they import), pyproject.toml (mypy's
settings), this script, and the Python, mypy and C compiler versions. Another checkout of
the same source (a clean clone, a worktree) then takes the extension modules from there.
`--no-cache` builds without reading or writing it (the gateway image's build).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import runpy
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import mypy.version
from mypyc.build import mypycify
from setuptools import setup

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVER = ROOT / "server"
PACKAGE = SERVER / "qosgate"
BUILD = ROOT / ".cache" / "native-build"
# Read without importing the package (its import refuses stale modules).
CACHE = runpy.run_path(str(PACKAGE / "paths.py"))["user_cache_dir"]() / "native"
KEEP = 8


def inputs_digest() -> str:
    """The SHA-256 of everything a build's output depends on."""
    digest = hashlib.sha256()
    sources = {str(path.relative_to(PACKAGE)): path for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyi")]}
    sources |= {"/pyproject.toml": ROOT / "pyproject.toml", "/build_native.py": pathlib.Path(__file__)}
    for name, path in sorted(sources.items()):
        digest.update(f"{name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    compiler = str(sysconfig.get_config_var("CC") or "cc").split()
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest.update(f"{sys.version}\0{mypy.version.__version__}\0{version}".encode())
    return digest.hexdigest()


def restore(entry: pathlib.Path) -> bool:
    """Copy a cached build's extension modules into the package; False if there is none."""
    if not entry.is_dir():
        return False
    for built in entry.rglob("*.so"):
        shutil.copy2(built, PACKAGE / built.relative_to(entry))
    entry.touch()
    return True


def keep(entry: pathlib.Path) -> None:
    """Store the package's extension modules as `entry`, then drop all but the newest KEEP."""
    CACHE.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=CACHE, prefix=".partial-"))
    for built in PACKAGE.rglob("*.so"):
        target = staging / built.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)
    try:
        staging.rename(entry)
    except OSError:  # another checkout stored the same build meanwhile
        shutil.rmtree(staging)
    entries = sorted((path for path in CACHE.iterdir() if not path.name.startswith(".")),
                     key=lambda path: path.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def compile_modules(native: dict) -> None:
    shutil.rmtree(BUILD, ignore_errors=True)
    BUILD.mkdir(parents=True)
    sources = [str(pathlib.Path("qosgate") / name) for name in native["MODULES"]]
    # mypyc names modules after their path from there; the type check reads pyproject's settings.
    cwd = os.getcwd()
    os.chdir(SERVER)
    try:
        extensions = mypycify(
            ["--config-file", str(ROOT / "pyproject.toml"), *sources],
            separate=[(sources, native["GROUP"])],
            target_dir=str(BUILD / "c"),
        )
        setup(
            name="qosgate-native",
            ext_modules=extensions,
            script_args=["--quiet", "build_ext", "--inplace", "--build-temp", str(BUILD / "temp"),
                         "--build-lib", str(BUILD / "lib")],
        )
    finally:
        os.chdir(cwd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the build cache")
    args = parser.parse_args()
    # Read the list without importing the package (its import refuses stale modules).
    native = runpy.run_path(str(PACKAGE / "native.py"))
    for old in PACKAGE.rglob("*.so"):
        old.unlink()
    record = PACKAGE / native["RECORD"]
    record.unlink(missing_ok=True)
    # Read before compiling: a module edited meanwhile then shows as stale, not as built.
    digests = {name: native["source_digest"](PACKAGE / name) for name in native["MODULES"]}
    entry = None if args.no_cache else CACHE / inputs_digest()
    if entry is not None and restore(entry):
        print(f"compiled modules from the build cache ({entry})")
    else:
        compile_modules(native)
        # Stored only if no source changed while it compiled.
        if entry is not None and entry == CACHE / inputs_digest():
            keep(entry)
    missing = [name for name in native["MODULES"] if not native["built"](PACKAGE / name)]
    if missing:
        print(f"mypyc built no extension module for {', '.join(missing)}", file=sys.stderr)
        return 1
    record.write_text("".join(f"{digest}  {name}\n" for name, digest in digests.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
