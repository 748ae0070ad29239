"""The command line of a dataclass config: `--key=value` or `--key value`, cast to each field's type, and a
`--help` generated from the class's own source (its fields, types, defaults and trailing comments).

Each field is declared once, with `setting`: its default, whether it defines the run (resuming with another
value stops), and the values it accepts.

    class Config:
        lr: float = setting(1e-3, run=False, above=0)   # a comment: the field's line in --help
    cfg = cli.parse(Config, argv, presets={"name": {...}})   # SystemExit naming the key on bad input
    cli.check(cfg)                                           # ... or a value the field does not accept
"""

import dataclasses
import inspect
import json
import math
import os
import re
import sys
import textwrap
import typing


class ConfigError(SystemExit):
    def __init__(self, key, message):
        super().__init__(f"config error: --{key}: {message}")


def setting(default=None, *, run, factory=None, choices=None, at_least=None, above=None, at_most=None, below=None):
    """A config field: its default (or a `factory` making it, for a list or dict), whether it defines the run
    (`run`, required: see `run_keys`), and what it accepts (`check`): one of `choices`, or a number >= at_least,
    > above, <= at_most, < below. None passes every check (an Optional field switched off)."""
    metadata = dict(run=run, choices=choices, at_least=at_least, above=above, at_most=at_most, below=below)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def run_keys(cls):
    """The names of the fields of `cls` that define a run. A field declared without `setting` has not said whether
    it does: TypeError, at the import of the class's module, rather than a resume check that skips it."""
    fields = dataclasses.fields(cls)
    unsaid = [f.name for f in fields if "run" not in f.metadata]
    if unsaid:
        raise TypeError(f"{cls.__name__}: declare {', '.join(unsaid)} with cli.setting(default, run=True or False)")
    return tuple(f.name for f in fields if f.metadata["run"])


def _bounds(m):
    """'must be >= 1', 'must be in (0, 1]', ... from a setting's bounds; None without bounds."""
    low = ("[", m["at_least"]) if m["at_least"] is not None else ("(", m["above"]) if m["above"] is not None else None
    high = ("]", m["at_most"]) if m["at_most"] is not None else (")", m["below"]) if m["below"] is not None else None
    if low and high:
        return f"must be in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"must be {'>=' if low[0] == '[' else '>'} {low[1]}"
    if high:
        return f"must be {'<=' if high[0] == ']' else '<'} {high[1]}"
    return None


def check(cfg):
    """ConfigError naming the first field whose value its `setting` does not accept."""
    for f in dataclasses.fields(cfg):
        value, m = getattr(cfg, f.name), f.metadata
        if value is None or not m:
            continue
        if m["choices"] is not None and value not in m["choices"]:
            raise ConfigError(f.name, f"one of {', '.join(m['choices'])}, got {value!r}")
        low_ok = ((m["at_least"] is None or value >= m["at_least"]) and (m["above"] is None or value > m["above"]))
        high_ok = ((m["at_most"] is None or value <= m["at_most"]) and (m["below"] is None or value < m["below"]))
        if not (low_ok and high_ok):
            raise ConfigError(f.name, f"{_bounds(m)}, got {value}")


def cast(key, value, typ):
    """Text from the command line -> the field's type: bool, int, float (finite), str, dict (JSON),
    list (comma-separated numbers), Optional[X] (also 'none')."""
    if typing.get_origin(typ) is typing.Union:  # Optional[X]
        if value.lower() in ("none", "null", ""):
            return None
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    try:
        if typ is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is float:
            number = float(value)
            if not math.isfinite(number):  # inf or nan would pass every range check
                raise ValueError
            return number
        if typ in (int, str):
            return typ(value)
        if typ is dict:
            parsed = json.loads(value)
            if not isinstance(parsed, dict):
                raise ValueError
            return parsed
        if typ is list:
            return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        pass
    expected = {dict: "a JSON object", list: "comma-separated numbers"}.get(typ, getattr(typ, "__name__", str(typ)))
    raise ConfigError(key, f"expected {expected}, got {value!r}")


def _type_name(typ):
    if typing.get_origin(typ) is typing.Union:
        return next(t for t in typing.get_args(typ) if t is not type(None)).__name__ + " or none"
    return {dict: "JSON object", list: "numbers, comma-separated"}.get(typ, typ.__name__)


def _field_comments(cls):
    """({field: [comment lines]}, {index of the first field after it: section comment}) from the class source.

    A field's comment is the text after '#' on its line, plus comment-only lines indented past the fields
    under it; a comment-only line at the fields' indentation starts a section.
    """
    comments, sections, last = {}, {}, None
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            if last is not None and len(line) - len(line.lstrip()) > 4:
                comments[last].append(stripped[1:].strip())
            else:
                sections[len(comments)], last = stripped[1:].strip(), None
            continue
        m = re.match(r"    (\w+)\s*:[^#]*(?:#\s?(.*))?$", line)
        if m and m.group(1) in cls.__dataclass_fields__:
            last = m.group(1)
            comments[last] = [m.group(2).strip()] if m.group(2) else []
    return comments, sections


def help_text(cls, doc="", presets=()):
    comments, sections = _field_comments(cls)
    hints, defaults = typing.get_type_hints(cls), cls()
    lines = [doc.strip(), "", "Settings (type, default), as --key=value or --key value:"] if doc else []
    for i, name in enumerate(hints):
        if i in sections:
            lines.append(f"\n  {sections[i]}")
        value = getattr(defaults, name)
        shown = (json.dumps(value) if isinstance(value, (dict, list)) or value == "" else
                 "none" if value is None else value)
        lines.append(f"    --{name} ({_type_name(hints[name])}, default {shown})")
        said = " ".join(comments.get(name, []))  # the comment as one paragraph, however the source wraps it
        lines += textwrap.wrap(said, 116, initial_indent=" " * 8, subsequent_indent=" " * 8)
    if presets:
        lines.append(f"\nPresets (--preset=NAME, then any setting overrides them): {', '.join(presets)}")
    return "\n".join(lines)


def _pairs(cls, argv):
    """--key=value and --key value (a bare --flag of a bool field means true) -> [(key, value)]."""
    hints = typing.get_type_hints(cls)
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(arg.lstrip("-").split("=")[0] or arg, f"settings are --key=value or --key value, "
                              f"got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if key not in hints:
            raise ConfigError(key, "unknown key (--help lists them all)")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            elif hints[key] is bool:
                value = "true"
            else:
                raise ConfigError(key, "needs a value: --key=value or --key value")
        pairs.append((key, value))
        i += 1
    return pairs


def parse(cls, argv, presets=None, doc=""):
    """An instance of dataclass `cls` from argv; a --preset=NAME's values first, so every other setting wins."""
    presets = presets or {}
    if "--help" in argv or "-h" in argv:
        try:
            print(help_text(cls, doc, presets), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; say nothing more (not even at exit)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    cfg, hints = cls(), typing.get_type_hints(cls)
    pairs = _pairs(cls, argv)
    for _, name in [p for p in pairs if p[0] == "preset"][-1:]:
        if name not in presets:
            raise ConfigError("preset", f"unknown preset {name!r} (known: {', '.join(presets)})")
        for key, value in presets[name].items():
            setattr(cfg, key, dict(value) if isinstance(value, dict) else value)
    for key, value in pairs:
        setattr(cfg, key, cast(key, value, hints[key]))
    return cfg
