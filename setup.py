"""The wheel's one build step beyond setuptools' own: the qosgate.v1 modules are generated
from protos/ into the build directory (scripts/gen_protos.py; they are never committed),
so a wheel built from a clean clone carries them. Everything else is in pyproject.toml."""

import pathlib
import runpy

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


class BuildWithProtos(build_py):
    """build_py, then the generated qosgate.v1 modules into the same build directory."""

    def run(self) -> None:
        super().run()
        generator = runpy.run_path(str(ROOT / "scripts" / "gen_protos.py"))
        if generator["generate"](pathlib.Path(self.build_lib)) != 0:
            raise SystemExit("generating the qosgate.v1 modules from protos/ failed")


setup(cmdclass={"build_py": BuildWithProtos})
