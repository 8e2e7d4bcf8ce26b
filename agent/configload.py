"""Load, merge and validate the agent config: defaults < YAML < ``TRAINGUARD_*`` env < CLI flags.

This is the only module that reads ``os.environ`` for configuration (it is handed the mapping, so
tests pass their own). Every failure is a :class:`ConfigError` naming the YAML key, the env var,
the offending value, where it came from, and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import shlex
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from trainguard.agent import rundir
from trainguard.agent.config import SECTIONS, TrainguardConfig
from trainguard.contract.configbase import (DOCS_CONFIG, ENV_PREFIX, ConfigError, FieldError, env_var_for,
                                           is_redacted_key, redact)
from trainguard.contract.protocol import RT_PREFIX

DEFAULT_CONFIG_PATH = "/etc/trainguard/agent.yaml"
CONFIG_PATH_ENV = "TRAINGUARD_CONFIG"
# Variables the agent writes for its workers (worker runtime link); never config keys.
RUNTIME_ENV_PREFIX = RT_PREFIX
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
TEXT_SHELL = "shell"
"""Field metadata ``{"text": "shell"}``: a list written as text (env var, ``--set``) is split into shell
words (``--steps 50`` -> two items), not at commas."""


class ConfigFileError(ConfigError):
    """The config file itself is missing or unreadable."""

    def __init__(self, path: str, message: str, fix: str) -> None:
        super().__init__("--config", f"config file {path}: {message}", fix, env_var=CONFIG_PATH_ENV)


def all_keys() -> list[str]:
    """Every dotted config key, in declaration order (frozen by a snapshot test)."""
    return [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _text_syntax(section: str, name: str) -> str:
    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == name:
            return str(f.metadata.get("text", ""))
    return ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, tp: Any, value: Any, source: str, *, from_text: bool, syntax: str = "") -> Any:
    """Check/convert ``value`` to the field type ``tp``; ``from_text`` for env vars and flags."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    secret = is_redacted_key(key)

    def bad(expected: str) -> ConfigError:
        got = type(value).__name__ if secret else f"{type(value).__name__} {value!r}"
        return ConfigError(key, f"expected {expected}, got {got}", f"give `{key}` a value of type {expected}",
                           source=source)

    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        # (every optional setting's None means "decided by the agent": `auto` names it, in YAML too)
        if value is None or (isinstance(value, str) and value.lower() == "auto") or (
                from_text and str(value).lower() in {"", "none", "null"}):
            return None
        return _coerce(key, non_none[0], value, source, from_text=from_text, syntax=syntax)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad("bool (true/false)")
    if tp is int:
        if isinstance(value, bool):
            raise bad("int")
        if isinstance(value, int):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad("int") from None
        raise bad("int")
    if tp is float:
        if isinstance(value, bool):
            raise bad("number")
        if isinstance(value, (int, float)):
            out = float(value)
        elif from_text and isinstance(value, str):
            try:
                out = float(value)
            except ValueError:
                raise bad("number") from None
        else:
            raise bad("number")
        if not math.isfinite(out):
            raise ConfigError(key, f"must be a finite number, got {value!r}",
                              f"give `{key}` a plain number (inf and nan are not allowed)", source=source)
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # YAML reads `job_id: 42` as an int; accept it as the string it is
        raise bad("string")
    if origin is list:
        if from_text and isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ConfigError(key, f"not a JSON list ({e.msg} at column {e.colno})",
                                      "write a JSON list, e.g. [\"a\", \"b\"]", source=source) from None
            elif syntax == TEXT_SHELL:
                try:
                    value = shlex.split(text)
                except ValueError as e:
                    raise ConfigError(key, f"not a list of shell words ({e})",
                                      "close the quote, or write a JSON list", source=source) from None
            else:
                value = [p.strip() for p in text.split(",") if p.strip()]
        if not isinstance(value, list):
            raise bad("list")
        (item_tp,) = args or (str,)
        return [_coerce(key, item_tp, v, source, from_text=from_text) for v in value]
    if origin is dict:
        if from_text and isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as e:
                raise ConfigError(key, f"not a JSON object ({e.msg} at column {e.colno})",
                                  'write a JSON object, e.g. {"a": "b"}', source=source) from None
        if not isinstance(value, dict):
            raise bad("mapping")
        _, val_tp = args or (str, Any)
        if val_tp is str:
            out_d: dict[str, Any] = {}
            for k, v in value.items():
                if isinstance(v, (dict, list)) or v is None:
                    raise ConfigError(key, f"the value of {k!r} is a {type(v).__name__}; values must be strings",
                                      f"quote the value of {k!r} (a list or mapping cannot be an environment "
                                      "variable)", source=source)
                out_d[str(k)] = str(v).lower() if isinstance(v, bool) else str(v)
            return out_d
        return dict(value)
    return value


def _suggest(word: str, choices: list[str]) -> str | None:
    close = difflib.get_close_matches(word, choices, n=1)
    return close[0] if close else None


def _unknown_key(key: str, where: str, keys: list[str]) -> ConfigError:
    """An unknown dotted key: the error names the likely key (and its env var), never the typo's."""
    guess = _suggest(key, keys)
    hint = f"did you mean `{guess}`? " if guess else ""
    return ConfigError(guess or key, f"unknown config key `{key}` in {where}",
                       f"{hint}every key is listed in {DOCS_CONFIG}", env_var=None if guess else "")


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key].line + 1})", key_node.start_mark)
        except TypeError:
            continue  # an unhashable key: construct_mapping below reports it
        seen[key] = key_node.start_mark
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str) -> dict[str, Any]:
    """Read the YAML file into a mapping of section -> mapping, with precise errors."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigFileError(path, "not found", f"create it (see systemd/agent.yaml.example) or pass --config / set {CONFIG_PATH_ENV}") from None
    except IsADirectoryError:
        raise ConfigFileError(path, "is a directory", "pass the path of the YAML file itself") from None
    except PermissionError:
        raise ConfigFileError(path, "permission denied", "make it readable by the agent's user") from None
    except UnicodeDecodeError as e:
        raise ConfigFileError(path, f"is not UTF-8 text (byte {e.start})", "save the file as UTF-8") from None
    except OSError as e:
        raise ConfigFileError(path, f"cannot be read ({e.strerror or type(e).__name__})", "check the path") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigFileError(path, f"invalid YAML{where}: {getattr(e, 'problem', None) or e}", "fix the YAML syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(path, f"top level must be a mapping of sections, got {type(data).__name__}",
                              f"start the file with one of the sections {list(SECTIONS)}")
    return data


def load_config(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> TrainguardConfig:
    """Build the effective config.

    ``path``: YAML file or None; ``env``: the environment (only ``TRAINGUARD_*`` is read);
    ``overrides``: dotted key -> value from CLI flags (strings are parsed like env values);
    ``defaults``: dotted key -> value replacing built-in defaults (``trainguard run`` uses
    per-user folders instead of ``/var``), below the file.
    """
    env = env or {}
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    sources: dict[str, str] = {}
    keys = all_keys()
    for key, raw in (defaults or {}).items():
        section, k = key.split(".", 1)  # text (Slurm's environment) is parsed like an env value
        values[section][k] = _coerce(key, _hints(SECTIONS[section])[k], raw, "default", from_text=isinstance(raw, str),
                                     syntax=_text_syntax(section, k))

    if path:
        data = read_yaml(path)
        for section, body in data.items():
            if section not in SECTIONS:
                guess = _suggest(str(section), list(SECTIONS))
                raise ConfigError(str(section), f"unknown section `{section}` in {path}",
                                  (f"did you mean `{guess}`? " if guess else "") + f"the sections are {list(SECTIONS)} "
                                  f"({DOCS_CONFIG})", env_var="")
            if body is None:
                continue
            if not isinstance(body, dict):
                raise ConfigError(section, f"section `{section}` must be a mapping, got {type(body).__name__}",
                                  f"write `{section}:` followed by indented `key: value` lines", source=path, env_var="")
            hints = _hints(SECTIONS[section])
            for k, v in body.items():
                key = f"{section}.{k}"
                if k not in hints:
                    raise _unknown_key(key, path, keys)
                values[section][k] = _coerce(key, hints[k], v, path, from_text=False, syntax=_text_syntax(section, k))
                sources[key] = path

    env_names = {env_var_for(k): k for k in keys}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name.startswith(RUNTIME_ENV_PREFIX) or name == CONFIG_PATH_ENV:
            continue
        key = env_names.get(name)
        if key is None:
            guess = _suggest(name, list(env_names))
            raise ConfigError(env_names[guess] if guess else name, f"unknown environment variable {name}",
                              (f"did you mean {guess}? " if guess else "") + "unset it or fix its name (env vars are "
                              f"TRAINGUARD_<SECTION>_<KEY>, listed in {DOCS_CONFIG})", env_var=guess or "")
        section, k = key.split(".", 1)
        values[section][k] = _coerce(key, _hints(SECTIONS[section])[k], raw, f"env {name}", from_text=True,
                                     syntax=_text_syntax(section, k))
        sources[key] = f"env {name}"

    for key, raw in (overrides or {}).items():
        section, _, k = key.partition(".")
        if section not in SECTIONS or k not in _hints(SECTIONS[section]):
            raise _unknown_key(key, "the command line", keys)
        values[section][k] = _coerce(key, _hints(SECTIONS[section])[k], raw, "command line",
                                     from_text=isinstance(raw, str), syntax=_text_syntax(section, k))
        sources[key] = "command line"

    if not values["agent"].get("state_dir"):
        values["agent"]["state_dir"] = rundir.default_state_dir(env)

    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        try:
            built[section] = cls(**values[section])
        except FieldError as e:
            key = f"{section}.{e.field}"
            raise ConfigError(key, e.message, e.fix, value=values[section].get(e.field),
                              source=sources.get(key, "default")) from None
    return TrainguardConfig(**built)


def redacted(cfg: TrainguardConfig) -> dict[str, Any]:
    """The effective config as a plain dict, every possible secret replaced by ``***`` (see
    :func:`trainguard.contract.configbase.redact`: by shape, not only by name)."""
    out = dataclasses.asdict(cfg)
    return {s: {k: redact(f"{s}.{k}", v) for k, v in body.items()} for s, body in out.items()}
