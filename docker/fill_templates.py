"""Fill a model-repository template (config.pbtxt files with ${name} placeholders).

    python3 docker/fill_templates.py docker/models/trtllm my-values.json /srv/triton/trtllm

Copies the template folder to the output folder and substitutes every placeholder from
the JSON values file. Strict both ways, so a typo cannot reach a server: a placeholder
without a value and a value no template uses are both errors. Standard library only, so
it runs anywhere a deployer has Python 3.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import string
import sys


def placeholders(text: str) -> set[str]:
    """Names of the ${name} placeholders in a template text."""
    return {
        named or braced
        for _, named, braced, _ in string.Template.pattern.findall(text)
        if named or braced
    }


def fill(text: str, values: dict[str, object]) -> str:
    """The template text with every placeholder replaced; KeyError names a missing one."""
    rendered = {key: _pbtxt_literal(value) for key, value in values.items()}
    return string.Template(text).substitute(rendered)


def _pbtxt_literal(value: object) -> str:
    # JSON true/false must appear in pbtxt as true/false, not Python's True/False.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def fill_repository(template: pathlib.Path, values: dict[str, object], out: pathlib.Path) -> None:
    if out.exists():
        raise SystemExit(f"{out} exists; choose a new output folder")
    configs = sorted(template.rglob("config.pbtxt"))
    used: set[str] = set()
    for config in configs:
        used |= placeholders(config.read_text())
    missing, unused = used - values.keys(), values.keys() - used
    if missing or unused:
        raise SystemExit(
            f"values do not match the templates in {template}: "
            f"missing {sorted(missing)}, unused {sorted(unused)}"
        )
    shutil.copytree(template, out, ignore=shutil.ignore_patterns("*.example.json"))
    for config in configs:
        target = out / config.relative_to(template)
        target.write_text(fill(config.read_text(), values))
    print(f"filled {len(configs)} config.pbtxt files into {out}")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    template, values_file, out = (pathlib.Path(a) for a in argv)
    fill_repository(template, json.loads(values_file.read_text()), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
