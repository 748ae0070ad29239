"""The command line of a dataclass config: `--key=value` or `--key value`, cast to each field's type, and a
`--help` generated from the class's own source (its fields, types, defaults and trailing comments).

    cfg = cli.parse(Config, argv, presets={"name": {...}})   # SystemExit naming the key on bad input
"""

import inspect
import json
import math
import re
import typing


class ConfigError(SystemExit):
    def __init__(self, key, message):
        super().__init__(f"config error: --{key}: {message}")


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
        lines += [f"        {c}" for c in comments.get(name, [])]
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
        print(help_text(cls, doc, presets))
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
