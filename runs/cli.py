"""The command line of a dataclass config: `--key=value` or `--key value`, cast to each field's type, and a
`--help` generated from the class's own source (its fields, types, defaults and trailing comments). A recipe
file (TOML: flat `key = value` lines of the same settings) may come first: `--config=FILE`, or `--preset=NAME`
for recipes/NAME.toml; the command line overrides it.

Each field is declared once, with `setting`: its default, whether it defines the run (resuming with another
value stops), and the values it accepts.

    class Config:
        lr: float = setting(1e-3, run=False, above=0)   # a comment: the field's line in --help
    cfg = cli.parse(Config, argv, recipes="recipes")   # SystemExit naming the key (file and line) on bad input
    cli.check(cfg)                                     # ... or a value the field does not accept
"""

import dataclasses
import difflib
import inspect
import json
import math
import os
import re
import sys
import textwrap
import tomllib
import typing


class ConfigError(SystemExit):
    """One line naming the setting (and, for a recipe file, the file and line) and what is wrong with it; or, made
    from several (`ConfigError.of(errors)`), one such line each."""
    def __init__(self, key, message, where=None):
        super().__init__(f"config error: {where + ': ' if where else ''}--{key}: {message}")

    @classmethod
    def of(cls, errors):
        """One error that says each of `errors` on a line of its own (a recipe's bad lines, all at once)."""
        if len(errors) == 1:
            return errors[0]
        joined = cls.__new__(cls)
        SystemExit.__init__(joined, "\n".join(str(e.code) for e in errors))
        return joined


def unknown_key(key, known, other_names=None):
    """The message for a key `known` lacks: our name for it where it is another trainer's (`other_names`:
    {their name: what to use here}), else the nearest known key when one is close."""
    if other_names and key in other_names:
        return f"unknown key; {other_names[key]}"
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    if near:
        return f"unknown key; did you mean --{near[0]}? (--help lists them all)"
    longer = sorted(k for k in known if k.startswith(key + "_"))  # a key's first word: --wandb for --wandb_mode
    if longer:
        return f"unknown key; did you mean {' or '.join(f'--{k}' for k in longer[:3])}? (--help lists them all)"
    return "unknown key (--help lists them all)"


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


def check_value(field, value, where=None):
    """ConfigError if `field`'s `setting` does not accept `value`."""
    m = field.metadata
    if value is None or not m:
        return
    if m["choices"] is not None and value not in m["choices"]:
        raise ConfigError(field.name, f"one of {', '.join(m['choices'])}, got {value!r}", where)
    low_ok = ((m["at_least"] is None or value >= m["at_least"]) and (m["above"] is None or value > m["above"]))
    high_ok = ((m["at_most"] is None or value <= m["at_most"]) and (m["below"] is None or value < m["below"]))
    if not (low_ok and high_ok):
        raise ConfigError(field.name, f"{_bounds(m)}, got {value}", where)


def check(cfg):
    """ConfigError naming the first field whose value its `setting` does not accept."""
    for f in dataclasses.fields(cfg):
        check_value(f, getattr(cfg, f.name))


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


def from_file(key, value, typ, where):
    """A recipe file's value (TOML already typed it) -> the field's type, as strictly as the command line:
    a bool for a bool, an integer for an int, a number for a float; a string is read as on the command line
    (so "none", a JSON object or "1,2" work too)."""
    if isinstance(value, str):
        try:
            return cast(key, value, typ)
        except ConfigError as e:
            raise ConfigError(key, str(e.code).split(": ", 2)[-1], where) from None
    inner = typ
    if typing.get_origin(typ) is typing.Union:
        inner = next(t for t in typing.get_args(typ) if t is not type(None))
    ok = (isinstance(value, bool) if inner is bool else
          isinstance(value, int) and not isinstance(value, bool) if inner is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) if inner is float
          else isinstance(value, dict) if inner is dict else
          isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
          if inner is list else False)
    if not ok:
        raise ConfigError(key, f"expected {_type_name(typ)}, got {value!r}", where)
    if inner is float:
        return float(value)
    if inner is list:
        return [float(v) for v in value]
    return value


def read_recipe(cls, path, other_names=None):
    """[(key, value, "path:line")] from a recipe file: flat TOML, `key = value` per line, the keys `cls`'s
    fields. Each problem names the file and line, and every bad line is named at once (a ConfigError of several
    lines), not only the first."""
    hints, fields = typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e.strerror or e}") from None
    try:
        table = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"{path} is not valid TOML: {e}") from None
    lines = raw.decode().splitlines()

    def line_of(key):  # the line that sets `key` (tomllib keeps no positions); flat files make this unambiguous
        pattern = re.compile(rf"""^\s*(["']?){re.escape(key)}\1\s*=""")
        return next((f"{path}:{i + 1}" for i, l in enumerate(lines) if pattern.match(l)), path)

    out, errors = [], []
    for key, value in table.items():
        try:
            out.append(_recipe_line(key, value, line_of(key), hints, fields, lines, path, other_names))
        except ConfigError as e:
            errors.append(e)
    if errors:
        raise ConfigError.of(errors)
    return out


def _recipe_line(key, value, where, hints, fields, lines, path, other_names):
    """(key, value, where) for one line of a recipe; ConfigError naming the line where it is bad."""
    if isinstance(value, dict) and hints.get(key) is not dict:
        where = next((f"{path}:{i + 1}" for i, l in enumerate(lines) if l.strip() == f"[{key}]"), where)
        raise ConfigError(key, "a recipe is flat: `key = value` lines, no [tables]", where)
    if key not in hints:
        raise ConfigError(key, unknown_key(key, hints, other_names), where)
    if key in ("config", "preset"):
        raise ConfigError(key, "a recipe cannot name another recipe", where)
    value = from_file(key, value, hints[key], where)
    check_value(fields[key], value, where)  # out of range: named here, with its line, not later without it
    return key, value, where


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


def help_text(cls, doc="", recipes=()):
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
        choices = cls.__dataclass_fields__[name].metadata.get("choices")
        if choices:
            said += f" (one of: {', '.join(choices)})"
        lines += textwrap.wrap(said, 116, initial_indent=" " * 8, subsequent_indent=" " * 8)
    if recipes:
        lines.append(f"\nRecipes (--preset=NAME for recipes/NAME.toml, or --config=FILE; then any setting overrides "
                     f"them): {', '.join(recipes)}")
    return "\n".join(lines)


def _pairs(cls, argv, other_names=None):
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
            raise ConfigError(key, unknown_key(key, hints, other_names))
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


def recipe_names(folder):
    """The recipes in `folder` (NAME for each NAME.toml), sorted; none when there is no such folder."""
    if not folder or not os.path.isdir(folder):
        return []
    return sorted(f[:-len(".toml")] for f in os.listdir(folder) if f.endswith(".toml"))


def parse(cls, argv, recipes=None, doc="", other_names=None):
    """An instance of dataclass `cls` from argv. A recipe's values come first (`--preset=NAME`: `recipes`/NAME.toml;
    `--config=FILE`; both: the preset, then the file), so every setting on the command line wins."""
    if "--help" in argv or "-h" in argv:
        try:
            print(help_text(cls, doc, recipe_names(recipes)), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; say nothing more (not even at exit)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    cfg, hints = cls(), typing.get_type_hints(cls)
    pairs = _pairs(cls, argv, other_names)
    files = []
    for _, name in [p for p in pairs if p[0] == "preset"][-1:]:
        if name not in recipe_names(recipes):
            raise ConfigError("preset", f"unknown preset {name!r} (known: {', '.join(recipe_names(recipes))})")
        files.append(os.path.join(recipes, name + ".toml"))
    files += [path for key, path in pairs if key == "config"][-1:]
    for path in files:
        for key, value, _ in read_recipe(cls, path, other_names):
            setattr(cfg, key, value)
    for key, value in pairs:
        setattr(cfg, key, cast(key, value, hints[key]))
    return cfg
