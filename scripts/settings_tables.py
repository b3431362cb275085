"""docs/reference/settings.md's settings tables, made from the settings dataclasses (their fields' help metadata).

    .venv/bin/python scripts/settings_tables.py          # rewrite the tables in docs/reference/settings.md
    .venv/bin/python scripts/settings_tables.py --check  # exit 1 if docs/reference/settings.md is stale

Each table sits between `<!-- settings:NAME -->` and `<!-- /settings:NAME -->` in docs/reference/settings.md;
tests/deployments/test_config.py fails while one is stale."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

SETTINGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "reference" / "settings.md"


def render() -> dict[str, str]:
    """{table name: markdown table}."""
    from deployments.config import serve_settings
    from deployments.config_fields import markdown_table, settings_of
    from deployments.serve_cli import launch_settings
    from engine import EngineConfig

    serve = serve_settings()
    return {
        "server": markdown_table([*(s for s in serve if s.group == "serve"), *launch_settings()],
                                 flags=True, docs=True),
        "server-engine": markdown_table([s for s in serve if s.owner == "engine"], flags=True, docs=False),
        "scaling": markdown_table([s for s in serve if s.group == "scaling"], flags=True, docs=True),
        "roles": markdown_table([s for s in serve if s.group == "roles"], flags=True, docs=True),
        "engine": markdown_table(settings_of(EngineConfig, "engine", EngineConfig()), flags=False, docs=True),
    }


def update(text: str) -> str:
    """`text` (the settings doc) with every marked table replaced by its rendering."""
    for name, table in render().items():
        pattern = re.compile(rf"(<!-- settings:{name} -->\n).*?(<!-- /settings:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{SETTINGS_DOC.name} has no <!-- settings:{name} --> ... <!-- /settings:{name} --> block")
        text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only check; exit 1 if the doc is stale")
    args = p.parse_args()
    old = SETTINGS_DOC.read_text()
    new = update(old)
    if args.check:
        if new != old:
            print(f"{SETTINGS_DOC}'s settings tables are stale: run scripts/settings_tables.py", file=sys.stderr)
            return 1
        return 0
    SETTINGS_DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
