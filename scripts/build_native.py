"""Compile the gateway's per-call modules with mypyc (run by `make native`).

The list is `qosgate.native.MODULES`; the extension modules land next to their source
(git ignores them) with the mypyc runtime in one shared library, `qosgate/_native__mypyc`,
and `qosgate/native.sha256` records the SHA-256 of each source as compiled (importing
qosgate compares it with the source it finds). Each build starts from scratch: the old
extension modules are removed first, so a module taken off the list runs interpreted again.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import shutil
import sys

from mypyc.build import mypycify
from setuptools import setup

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVER = ROOT / "server"
PACKAGE = SERVER / "qosgate"
BUILD = ROOT / ".cache" / "native-build"


def main() -> int:
    # Read the list without importing the package (its import refuses stale modules).
    native = runpy.run_path(str(PACKAGE / "native.py"))
    for old in PACKAGE.rglob("*.so"):
        old.unlink()
    record = PACKAGE / native["RECORD"]
    record.unlink(missing_ok=True)
    # Read before compiling: a module edited meanwhile then shows as stale, not as built.
    digests = {name: native["source_digest"](PACKAGE / name) for name in native["MODULES"]}
    shutil.rmtree(BUILD, ignore_errors=True)
    BUILD.mkdir(parents=True)
    sources = [str(pathlib.Path("qosgate") / name) for name in native["MODULES"]]
    # mypyc names modules after their path from here; the type check reads pyproject's settings.
    os.chdir(SERVER)
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
    missing = [name for name in native["MODULES"] if not native["built"](PACKAGE / name)]
    if missing:
        print(f"mypyc built no extension module for {', '.join(missing)}", file=sys.stderr)
        return 1
    record.write_text("".join(f"{digest}  {name}\n" for name, digest in digests.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
