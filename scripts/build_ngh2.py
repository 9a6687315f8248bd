"""Build and install ngh2 (the relay's libnghttp2 binding) with one option added.

libnghttp2 resets a stream whose header value starts or ends with a space or tab (RFC 9113
8.2.1) unless the session is created with
`nghttp2_option_set_no_rfc9113_leading_and_trailing_ws_validation`; gRPC servers take such
a value and trim it, and gRPC clients send them (`authorization: Bearer ` with an empty
key). ngh2 0.3.0 does not expose that option, so a caller's stray space was answered with
a stream reset (INTERNAL to the caller) instead of a status. This script builds ngh2 from
its published source with the option exposed as
`Configuration(leading_and_trailing_ws_validation=...)` (default True, as before) and
installs it over the wheel pip put in the venv. `transport/http2.py` passes False when the
option is there; with PyPI's build the gateway warns at its start that such values reset
the stream.

`python scripts/build_ngh2.py [--wheel-dir DIR]`: the wheel is kept in DIR and reused
while this script is unchanged (default: `$XDG_CACHE_HOME/qosgate/wheels/` under this
script's SHA-256, so every checkout of the same script shares one build; `~/.cache` without
XDG_CACHE_HOME); run by `make venv` and the gateway image's build.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import runpy
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
VERSION = "0.3.0"
SDIST_SHA256 = "09b995aa65b8a397de652fd7a9b3877d6d1e24c10d2effc36204a3f37aa73440"
# The local version label marks the build; `ngh2==0.3.0` in pyproject.toml accepts it.
LOCAL = f"{VERSION}+qosgate.ws1"
OPTION = "leading_and_trailing_ws_validation"
# This interpreter's builds of it (a wheel directory may hold others').
WHEELS = f"ngh2-{LOCAL}-cp{sys.version_info.major}{sys.version_info.minor}-*.whl"

# (file, text that must be there once, text that replaces it)
EDITS = (
    (
        "src/ngh2/_version.py",
        f'__version__ = "{VERSION}"',
        f'__version__ = "{LOCAL}"',
    ),
    (
        "src/ngh2/config.py",
        "    max_inbound_header_count: int = 1_024\n",
        "    max_inbound_header_count: int = 1_024\n"
        f"    {OPTION}: bool = True\n"
        '    """False: accept field values with leading or trailing whitespace (the\n'
        "    application trims them) instead of resetting the stream (RFC 9113 8.2.1).\"\"\"\n",
    ),
    (
        "src/ngh2/_nghttp2.pxd",
        "    void nghttp2_option_set_builtin_recv_extension_type(\n",
        "    void nghttp2_option_set_no_rfc9113_leading_and_trailing_ws_validation(\n"
        "        nghttp2_option *option,\n"
        "        int val,\n"
        "    )\n"
        "    void nghttp2_option_set_builtin_recv_extension_type(\n",
    ),
    (
        "src/ngh2/_core.pyx",
        "    _nghttp2.nghttp2_option_set_glitch_rate_limit(option, glitch_burst, glitch_rate)\n",
        "    _nghttp2.nghttp2_option_set_glitch_rate_limit(option, glitch_burst, glitch_rate)\n"
        "    _nghttp2.nghttp2_option_set_no_rfc9113_leading_and_trailing_ws_validation(\n"
        f"        option, not config.{OPTION},\n"
        "    )\n",
    ),
)


def default_wheel_dir() -> pathlib.Path:
    """Where the builds of this script, as it is now, are kept."""
    cache = runpy.run_path(str(ROOT / "server" / "qosgate" / "paths.py"))["user_cache_dir"]()
    return cache / "wheels" / hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:16]


def installed() -> bool:
    """Whether the running interpreter's ngh2 is this build."""
    try:
        import ngh2  # noqa: PLC0415 - checked before and after the install
    except ImportError:
        return False
    return OPTION in getattr(ngh2.Configuration, "__dataclass_fields__", {})


def build(wheel_dir: pathlib.Path) -> pathlib.Path:
    """The patched wheel, from `wheel_dir` when an earlier run built it."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(wheel_dir.glob(WHEELS))
    if found:
        return found[-1]
    with tempfile.TemporaryDirectory(prefix="ngh2-build-") as tmp:
        work = pathlib.Path(tmp)
        pip = [sys.executable, "-m", "pip"]
        subprocess.run(
            [*pip, "download", "-q", "--no-deps", "--no-binary", ":all:", f"ngh2=={VERSION}", "-d", str(work)],
            check=True,
        )
        sdist = work / f"ngh2-{VERSION}.tar.gz"
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise SystemExit(f"ngh2-{VERSION}.tar.gz: sha256 {digest}, expected {SDIST_SHA256}")
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = work / f"ngh2-{VERSION}"
        for name, old, new in EDITS:
            path = source / name
            text = path.read_text()
            if text.count(old) != 1:
                raise SystemExit(f"{name}: the text to patch is not there once; ngh2 changed?")
            path.write_text(text.replace(old, new))
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(wheel_dir), str(source)], check=True)
    found = sorted(wheel_dir.glob(WHEELS))
    if not found:
        raise SystemExit(f"no ngh2 {LOCAL} wheel in {wheel_dir}")
    return found[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", type=pathlib.Path, default=default_wheel_dir())
    args = parser.parse_args()
    wheel = build(args.wheel_dir)
    if not installed():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], check=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
