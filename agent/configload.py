"""Load, merge and validate the agent config: defaults < YAML < ``TRAINGUARD_*`` env < CLI flags.

This is the only module that reads ``os.environ`` for configuration (it is handed the mapping, so
tests pass their own). Every failure is a :class:`ConfigError` naming the YAML key, the env var,
the offending value, where it came from, and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from trainguard.agent.config import SECTIONS, TrainguardConfig
from trainguard.runtime.configbase import ENV_PREFIX, ConfigError, FieldError, env_var_for, is_secret
from trainguard.runtime.protocol import RT_PREFIX

DEFAULT_CONFIG_PATH = "/etc/trainguard/agent.yaml"
CONFIG_PATH_ENV = "TRAINGUARD_CONFIG"
# Variables the agent writes for its workers (worker runtime link); never config keys.
RUNTIME_ENV_PREFIX = RT_PREFIX
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigFileError(ConfigError):
    """The config file itself is missing or unreadable."""

    def __init__(self, path: str, message: str, fix: str) -> None:
        ValueError.__init__(self, f"config file {path}: {message}. Fix: {fix}")
        self.key, self.env_var, self.message, self.fix, self.value, self.source = (
            "--config", CONFIG_PATH_ENV, message, fix, path, "")


def all_keys() -> list[str]:
    """Every dotted config key, in declaration order (frozen by a snapshot test)."""
    return [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, tp: Any, value: Any, source: str, *, from_text: bool) -> Any:
    """Check/convert ``value`` to the field type ``tp``; ``from_text`` for env vars and flags."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def bad(expected: str) -> ConfigError:
        return ConfigError(key, f"expected {expected}, got {type(value).__name__} {value!r}",
                           f"give `{key}` a value of type {expected}", value=value, source=source)

    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (from_text and str(value).lower() in {"", "none", "null", "auto"}):
            return None
        return _coerce(key, non_none[0], value, source, from_text=from_text)
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
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad("number") from None
        raise bad("number")
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
                    raise ConfigError(key, f"not a JSON list: {e}", "use a JSON list or comma-separated values",
                                      value=value, source=source) from None
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
                raise ConfigError(key, f"not a JSON object: {e}", 'use a JSON object, e.g. {"a": "b"}',
                                  value=value, source=source) from None
        if not isinstance(value, dict):
            raise bad("mapping")
        return dict(value)
    return value


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f"did you mean `{close[0]}`? " if close else ""


def read_yaml(path: str) -> dict[str, Any]:
    """Read the YAML file into a mapping of section -> mapping, with precise errors."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigFileError(path, "not found", f"create it (see systemd/agent.yaml.example) or pass --config / set {CONFIG_PATH_ENV}") from None
    except PermissionError:
        raise ConfigFileError(path, "permission denied", "make it readable by the agent's user") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigFileError(path, f"invalid YAML{where}: {getattr(e, 'problem', e)}", "fix the YAML syntax") from None
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
        section, k = key.split(".", 1)
        values[section][k] = raw

    if path:
        data = read_yaml(path)
        for section, body in data.items():
            if section not in SECTIONS:
                raise ConfigError(str(section), f"unknown section in {path}; {_suggest(str(section), list(SECTIONS))}".rstrip("; "),
                                  f"use one of {list(SECTIONS)}", source=path)
            if body is None:
                continue
            if not isinstance(body, dict):
                raise ConfigError(section, f"section must be a mapping, got {type(body).__name__}",
                                  f"write `{section}:` followed by indented `key: value` lines", source=path)
            hints = _hints(SECTIONS[section])
            for k, v in body.items():
                key = f"{section}.{k}"
                if k not in hints:
                    raise ConfigError(key, f"unknown key in {path}; {_suggest(key, keys)}".rstrip("; "),
                                      f"remove it or use one of the `{section}.*` keys in docs/configuration.md", source=path)
                values[section][k] = _coerce(key, hints[k], v, path, from_text=False)
                sources[key] = path

    env_names = {env_var_for(k): k for k in keys}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name.startswith(RUNTIME_ENV_PREFIX) or name == CONFIG_PATH_ENV:
            continue
        key = env_names.get(name)
        if key is None:
            close = difflib.get_close_matches(name, list(env_names), n=1)
            hint = f"did you mean {close[0]} (`{env_names[close[0]]}`)?" if close else ""
            raise ConfigError(env_names[close[0]] if close else name, f"unknown environment variable {name}; {hint}".rstrip("; "),
                              "unset it or fix its name (env vars are TRAINGUARD_<SECTION>_<KEY>)", value=raw, source=f"env {name}")
        section, k = key.split(".", 1)
        values[section][k] = _coerce(key, _hints(SECTIONS[section])[k], raw, f"env {name}", from_text=True)
        sources[key] = f"env {name}"

    for key, raw in (overrides or {}).items():
        section, k = key.split(".", 1)
        values[section][k] = _coerce(key, _hints(SECTIONS[section])[k], raw, "command line",
                                     from_text=isinstance(raw, str))
        sources[key] = "command line"

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
    """The effective config as a plain dict with every secret replaced by ``***``."""

    def scrub(key: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: scrub(f"{key}.{k}", v) for k, v in value.items()}
        if is_secret(key) and value not in ("", None):
            return "***"
        return value

    out = dataclasses.asdict(cfg)
    return {s: {k: scrub(f"{s}.{k}", v) for k, v in body.items()} for s, body in out.items()}
