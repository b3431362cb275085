"""Settings as data: one `Setting` per field of a settings dataclass, read from the field's type and
its metadata (`engine.config.setting`). The CLI's flags, the value checks of `ServeConfig.from_dict`
(YAML, `build_app(args)`) and docs/reference/settings.md's tables are all made from these, so they cannot
drift apart.

Naming: a field `foo_bar` is the YAML key `foo_bar` and the flag `--foo-bar` (a bool: `--foo-bar` /
`--no-foo-bar`); an alias is a second name for the same field, in both places."""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, fields
from enum import Enum
from typing import Any, NamedTuple


class Kind(Enum):
    """How a setting's value is written on the command line and checked in YAML."""

    INT = "integer"
    FLOAT = "number"
    STR = "string"
    BOOL = "boolean"
    CHOICE = "choice"
    RESOURCES = "JSON object of resource amounts"


class Setting(NamedTuple):
    name: str  # the dataclass field, the YAML key
    owner: str  # "serve", "engine" or "launch": which dataclass holds it
    kind: Kind
    optional: bool  # None is a valid value (written `none` on the command line)
    choices: tuple[str, ...]  # Kind.CHOICE only
    default: Any  # the default where it is used (the server's default engine, not EngineConfig's)
    help: str
    doc: str  # more detail, the settings doc only
    default_doc: str  # how to read the default, where `default` alone would not say it
    cli: bool  # False: not a flag (YAML / code only)
    group: str  # the table and the `--help` section it is listed in
    aliases: tuple[str, ...] = ()

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple("--" + n.replace("_", "-") for n in (self.name, *self.aliases))

    @property
    def keys(self) -> tuple[str, ...]:
        """Every name that sets it in YAML / `from_dict`."""
        return (self.name, *self.aliases)

    def parse(self, text: str) -> Any:
        """A command-line string as this setting's value; ValueError says what was expected."""
        if self.optional and text.strip().lower() == "none":
            return None
        try:
            if self.kind is Kind.INT:
                return int(text)
            if self.kind is Kind.FLOAT:
                return float(text)
            if self.kind is Kind.RESOURCES:
                return self.check(json.loads(text))
        except (json.JSONDecodeError, ValueError):
            raise ValueError(self._expected(text)) from None
        return self.check(text)

    def check(self, value: Any) -> Any:
        """A YAML / dict value checked against this setting's type (an int is a fine float);
        ValueError says what was expected."""
        if value is None and self.optional:
            return None
        ok = {Kind.INT: isinstance(value, int) and not isinstance(value, bool),
              Kind.FLOAT: isinstance(value, (int, float)) and not isinstance(value, bool),
              Kind.STR: isinstance(value, str), Kind.BOOL: isinstance(value, bool),
              Kind.CHOICE: value in self.choices,
              Kind.RESOURCES: isinstance(value, dict) and all(
                  isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                  for k, v in value.items())}[self.kind]
        if not ok:
            raise ValueError(self._expected(value))
        if self.kind is Kind.FLOAT:
            return float(value)
        return dict(value) if self.kind is Kind.RESOURCES else value

    def _expected(self, value: Any) -> str:
        article = "an" if self.kind.value[0] in "aeiou" else "a"
        what = f"one of {', '.join(self.choices)}" if self.kind is Kind.CHOICE else f"{article} {self.kind.value}"
        if self.kind is Kind.RESOURCES:
            what += ' such as {"prefill": 1}'
        return f"expected {what}{' or none' if self.optional else ''}, got {value!r}"

    def default_text(self) -> str:
        if self.default_doc:
            return self.default_doc
        if self.kind is Kind.BOOL:
            return "on" if self.default else "off"
        if self.default is None or self.default == {}:
            return "none"
        return str(self.default)


def _kind(hint: Any) -> tuple[Kind, bool, tuple[str, ...]]:
    """(kind, optional, choices) of a resolved type hint."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        (hint,) = args
    if typing.get_origin(hint) is typing.Literal:
        return Kind.CHOICE, optional, tuple(typing.get_args(hint))
    if typing.get_origin(hint) is dict:
        return Kind.RESOURCES, optional, ()
    kinds = {bool: Kind.BOOL, int: Kind.INT, float: Kind.FLOAT, str: Kind.STR}
    return kinds[hint], optional, ()


def settings_of(cls: type, owner: str, defaults: Any, aliases: dict[str, str] | None = None,
                skip: frozenset[str] = frozenset()) -> list[Setting]:
    """One `Setting` per field of dataclass `cls` (but `skip`), with the defaults of the instance
    `defaults` and `aliases` ({alias: field}). Every field must carry a help text."""
    by_field: dict[str, list[str]] = {}
    for alias, name in (aliases or {}).items():
        by_field.setdefault(name, []).append(alias)
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        assert meta.get("help"), f"{cls.__name__}.{f.name} has no help: declare it with setting(...)"
        assert f.default is not MISSING or f.default_factory is not MISSING, f.name
        kind, optional, choices = _kind(hints[f.name])
        default = getattr(defaults, f.name)
        declared = f.default if f.default is not MISSING else f.default_factory()
        # `default_doc` reads the declared default; one set by `defaults` (the server's engine) speaks for itself.
        default_doc = meta.get("default_doc", "") if default == declared else ""
        out.append(Setting(f.name, owner, kind, optional, choices, default, meta["help"],
                           meta.get("doc", ""), default_doc, meta.get("cli", True),
                           meta.get("group") or owner, tuple(by_field.get(f.name, ()))))
    return out


def _default_cell(s: Setting) -> str:
    if not s.default_doc and s.kind in (Kind.STR, Kind.CHOICE) and s.default is not None:
        return f"`{s.default}`"
    return s.default_text()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(settings: list[Setting], *, flags: bool, docs: bool) -> str:
    """A settings-doc table: one row per setting. `flags`: name them as flags (a YAML-only setting by its
    key); else by field name. `docs`: add each setting's longer `doc` to its help."""
    head = "| flag | default | meaning |" if flags else "| setting | default | meaning |"
    rows = [head, "|---|---|---|"]
    for s in settings:
        if not flags:
            name = f"`{s.name}`"
        elif not s.cli:
            name = f"`{s.name}` (YAML only)"
        elif s.kind is Kind.BOOL:
            name = ", ".join(f"`--[no-]{f[2:]}`" for f in s.flags)
        else:
            name = ", ".join(f"`{f}`" for f in s.flags)
        meaning = s.help + (f". {s.doc}" if docs and s.doc else "")
        if s.owner == "launch":
            meaning += " (command line only)"
        rows.append(f"| {name} | {_cell(_default_cell(s))} | {_cell(meaning)} |")
    return "\n".join(rows)
