"""Config loading: YAML files with `base:` inheritance and dotted CLI overrides, into typed dataclasses.

Precedence, written once here: dataclass defaults < `base:` ancestors < the named YAML < CLI overrides.
Every value is coerced by its field's type (YAML reads `1e-3` as a string), and every mistake raises one
`ConfigError` that names the file, the dotted key and the nearest valid key — before any process group,
dataset or model exists.

Each section's dataclass sits beside the component that reads it; a recipe's root config only nests them.
A field is documented by the string literal on the line below it (read from the source), which feeds
`--help` (`reference`) and the test that fails on an undocumented field.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import subprocess
import textwrap
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

# PyYAML is imported by the functions that read or write YAML, not here: the GPU check (scripts/gpu_check.py)
# builds the trainer's components on a cluster's Python, which may not have it.

T = TypeVar("T")


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the key and the fix."""


# ---------------------------------------------------------------- loading


def load_yaml_chain(path: str | Path, _seen: tuple[Path, ...] = ()) -> tuple[dict, dict[str, Path]]:
    """Read `path` and its `base:` ancestors; return the merged dict and, per dotted key, the file that set it."""
    import yaml

    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"{path}: base: inheritance cycle ({chain})")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    merged: dict = {}
    origin: dict[str, Path] = {}
    bases = raw.pop("base", None) or []
    for base in [bases] if isinstance(bases, str) else bases:
        base_dict, base_origin = load_yaml_chain(path.parent / base, (*_seen, path))
        _deep_merge(merged, base_dict)
        origin.update(base_origin)
    _deep_merge(merged, raw)
    origin.update({k: path for k in _dotted_keys(raw)})
    return merged, origin


def _deep_merge(dst: dict, src: dict) -> None:
    """Merge `src` into `dst`: mappings merge key by key, anything else (lists included) replaces."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value)
        else:
            dst[key] = value


def _dotted_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in d.items():
        out.append(prefix + str(key))
        if isinstance(value, dict):
            out += _dotted_keys(value, f"{prefix}{key}.")
    return out


def parse_overrides(overrides: list[str]) -> dict:
    """`["optim.lr=0.5", "train.epochs=3"]` -> nested dict; values parsed as YAML, coerced later by type."""
    import yaml

    out: dict = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or key.startswith(".") or key.endswith("."):
            raise ConfigError(f"override {item!r}: expected section.key=value (e.g. optim.lr=0.5)")
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is set twice")
        try:
            node[leaf] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            node[leaf] = value
    return out


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build a `cls` instance from defaults, the YAML at `path` (with its bases) and dotted overrides."""
    data, origin = load_yaml_chain(path) if path else ({}, {})
    cli = parse_overrides(overrides or [])
    _deep_merge(data, cli)
    origin.update({k: "command line" for k in _dotted_keys(cli)})
    return build_dataclass(cls, data, origin)


# ---------------------------------------------------------------- coercion and validation


def build_dataclass(cls: type[T], data: Any, origin: dict[str, Any] | None = None, prefix: str = "") -> T:
    """Recursively construct dataclass `cls` from a plain mapping, coercing by field type."""
    origin = origin or {}
    where = _where(origin, prefix.rstrip(".") or None)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            dotted = prefix + str(key)
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else f" (valid: {', '.join(fields)})"
            raise ConfigError(f"{_where(origin, dotted)}{dotted}: unknown key{hint}")
    kwargs = {name: _coerce(hints[name], data[name], prefix + name, origin) for name in fields if name in data}
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own __post_init__ check; its message starts with the dotted key
        raise ConfigError(f"{where}{e}") from None


def _where(origin: dict[str, Any], dotted: str | None) -> str:
    src = origin.get(dotted) if dotted else None
    return f"{src}: " if src else ""


def _coerce(tp: Any, value: Any, dotted: str, origin: dict[str, Any]) -> Any:
    def fail(expected: str) -> ConfigError:
        return ConfigError(f"{_where(origin, dotted)}{dotted}: expected {expected}, got {value!r}")

    origin_tp, args = get_origin(tp), get_args(tp)
    if origin_tp in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(a, value, dotted, origin)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin_tp is Literal:
        if isinstance(value, bool):  # YAML 1.1 reads off/on/no/yes as booleans: `amp: off` means "off"
            value = next((a for a in args if isinstance(a, str) and a in (("on", "yes") if value else ("off", "no"))),
                         value)
        if value in args:
            return value
        choices = ", ".join(map(str, args))
        near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.5)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"{_where(origin, dotted)}{dotted}: {value!r} is not one of {choices}{hint}")
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, origin, dotted + ".")
    if origin_tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise fail(f"a list of {getattr(args[0], '__name__', args[0]) if args else 'values'}")
        if origin_tp is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise fail(f"a list of {len(args)} values")
            return tuple(_coerce(a, v, f"{dotted}[{i}]", origin) for i, (a, v) in enumerate(zip(args, value)))
        item_tp = args[0] if args else Any
        items = [_coerce(item_tp, v, f"{dotted}[{i}]", origin) for i, v in enumerate(value)]
        return tuple(items) if origin_tp is tuple else items
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail("true or false")
    if tp is int:
        if isinstance(value, bool):
            raise fail("an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise fail("an integer")
    if tp is float:
        if isinstance(value, bool):
            raise fail("a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise fail("a number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise fail("a string")
    if tp is Any:
        return value
    raise ConfigError(f"{dotted}: unsupported field type {tp!r}")  # a bug in a dataclass, not user input


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless `ok`; used by the sections' `__post_init__` checks."""
    if not ok:
        raise ConfigError(message)


# ---------------------------------------------------------------- output and docs


def to_dict(cfg: Any) -> Any:
    """A plain, YAML-safe dict of a (nested) dataclass config."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def git_commit() -> str:
    """The repository's commit (with `+dirty` when tracked files are modified), or 'unknown' outside a git
    checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if sha.returncode != 0:
        return "unknown"
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config (with the git commit) so that it travels with the run."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"git_commit": git_commit(), **to_dict(cfg)}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the docstring literal written on the line below the field in `cls`'s source
    (inherited fields included: a section may extend another, e.g. a recipe's `train` section)."""
    docs = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "|".join(map(str, get_args(tp)))
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    if get_origin(tp) in (list, tuple):
        return f"list[{', '.join(_type_name(a) for a in get_args(tp) if a is not Ellipsis)}]"
    return getattr(tp, "__name__", str(tp))


def reference(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) for every field of a root config, sections expanded."""
    import yaml

    rows = []
    hints, docs = get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows += reference(tp, f"{prefix}{f.name}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = to_dict(f.default_factory())
        else:
            default = "(required)"
        rows.append((prefix + f.name, _type_name(tp), yaml.safe_dump(default, default_flow_style=True).strip()
                     .removesuffix("...").strip(), docs.get(f.name, "")))
        inner = [a for a in get_args(tp) if dataclasses.is_dataclass(a)]
        for sub in inner:
            rows += reference(sub, f"{prefix}{f.name}[].")
    return rows


def format_reference(cls: type) -> str:
    """The config reference as text, one key per block: what `--help` prints."""
    lines = []
    for key, tp, default, doc in reference(cls):
        lines.append(f"  {key}: {tp} = {default}")
        lines.append(textwrap.fill(doc, width=100, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)
