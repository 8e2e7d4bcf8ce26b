"""Building blocks for typed config sections.

Every component owns one ``@dataclass(kw_only=True, slots=True)`` section with a docstring under
each field and cross-field checks in ``__post_init__`` (the torchtitan pattern). A check raises
:class:`FieldError` naming the *field*; the loader (:mod:`trainguard.agent.configload`) knows where the
section sits and rewrites it into a :class:`ConfigError` that names the YAML key, the environment
variable and the fix. Components never read ``os.environ``: only the loader does.

Secrets are recognised by *shape*, not only by name (:func:`redact`, :func:`is_redacted_key`):
everything under ``checkpoint.storage_options`` and the values of ``workers.env`` and
``workers.args`` are hidden unless their key is on a short allow-list, and so is any string whose key
looks like a credential (secret, token, key, password, passwd, credential, private). An error about
such a key never echoes its value.
"""

from __future__ import annotations

import math
import re
from typing import Any

ENV_PREFIX = "TRAINGUARD_"
REDACTED = "***"
DOCS_CONFIG = "docs/configuration.md"
"""The page that lists every key (cited by unknown-key errors; a docs test checks it exists)."""


class FieldError(ValueError):
    """A section-level validation failure: which field, what is wrong, how to fix it."""

    def __init__(self, field: str, message: str, fix: str) -> None:
        super().__init__(f"{field}: {message}. Fix: {fix}")
        self.field = field
        self.message = message
        self.fix = fix


class ConfigError(ValueError):
    """A user-facing configuration error: ``<what> (<YAML key> / <env var>): <fix>``.

    The CLI prints it as ``trainguard: <str(error)>`` and exits 2. ``value`` is shown only when
    the key cannot hold a secret (:func:`is_redacted_key`); ``env_var`` may be overridden (or set to
    ``""``) when the key is not a config key (e.g. ``--socket``).
    """

    def __init__(self, key: str, message: str, fix: str, *, value: Any = None, source: str = "",
                 env_var: str | None = None) -> None:
        self.key = key
        self.env_var = env_for_key(key) if env_var is None else env_var
        self.message = message
        self.fix = fix
        self.value = None if is_redacted_key(key) else value
        self.source = source
        super().__init__(self._text())

    def _text(self) -> str:
        what = self.message
        if self.value is not None and repr(self.value) not in what and str(self.value) not in what:
            what += f" (got {self.value!r})"
        if self.source:
            what += f", from {self.source}"
        where = f"{self.key} / {self.env_var}" if self.env_var else self.key
        return f"{what} ({where}): {self.fix}"


_KEY_RE = re.compile(r"^[a-z][a-z0-9]*\.[a-z][a-z0-9_]*$")


def env_var_for(key: str) -> str:
    """``checkpoint.keep_last`` -> ``TRAINGUARD_CHECKPOINT_KEEP_LAST``.

    Section names contain no underscore, so the first ``_`` after the prefix always ends the
    section name and the mapping is reversible.
    """
    return ENV_PREFIX + key.replace(".", "_").upper()


def env_for_key(key: str) -> str:
    """The env var of a well-formed dotted key, else ``""`` (a section name, a CLI flag, a typo)."""
    return env_var_for(key) if _KEY_RE.match(key) else ""


def require(cond: bool, field: str, message: str, fix: str) -> None:
    """Raise :class:`FieldError` unless ``cond`` holds."""
    if not cond:
        raise FieldError(field, message, fix)


def require_finite(value: float, field: str, *, minimum: float | None = None, positive: bool = False,
                   fix: str = "") -> None:
    """A number setting must be finite, and ``> 0`` (``positive``) or ``>= minimum``."""
    require(isinstance(value, (int, float)) and math.isfinite(value), field, f"must be a finite number, got {value!r}",
            fix or "give a plain number of seconds/units")
    if positive:
        require(value > 0, field, f"must be > 0, got {value!r}", fix or "give a positive number")
    if minimum is not None:
        require(value >= minimum, field, f"must be >= {minimum:g}, got {value!r}", fix or f"use at least {minimum:g}")


# ---- secrets -------------------------------------------------------------------------------------

SECRET_MARKERS = ("secret", "token", "key", "password", "passwd", "credential", "private", "auth")
"""A key containing one of these (case-insensitive) names a credential when its value is a string."""

SHAPE_REDACTED = ("checkpoint.storage_options", "workers.env", "workers.args")
"""Keys whose values are hidden whatever they are called: credentials hide there under any name."""

STORAGE_OPTIONS_ALLOWED = frozenset({
    "endpoint_url", "region_name", "region", "project", "anon", "use_ssl", "requester_pays",
    "client_kwargs", "config_kwargs", "default_block_size", "version_aware", "signature_version",
    "addressing_style", "s3",
})
"""``checkpoint.storage_options`` keys shown in clear (nested mappings are checked key by key)."""

WORKER_ENV_ALLOWED = ("NCCL_", "GLOO_", "OMP_", "MKL_", "CUDA_", "TORCH_", "PYTORCH_", "PYTHON", "LOGLEVEL",
                      "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")
"""``workers.env`` names (or prefixes) whose values are shown, unless the name looks like a credential."""


def name_is_secret(name: str) -> bool:
    """Whether a (possibly dotted) key's last part looks like a credential's name."""
    leaf = str(name).rsplit(".", 1)[-1].lower()
    return any(m in leaf for m in SECRET_MARKERS)


def is_secret(key: str) -> bool:
    """Kept for callers of the old name: see :func:`name_is_secret`."""
    return name_is_secret(key)


def is_redacted_key(key: str) -> bool:
    """Whether values of ``key`` may be secrets: never echo them in errors or logs."""
    return any(key == k or key.startswith(k + ".") for k in SHAPE_REDACTED) or name_is_secret(key)


def _redact_storage_options(value: Any) -> Any:
    if not isinstance(value, dict):
        return REDACTED
    out: dict[str, Any] = {}
    for k, v in value.items():
        if str(k) in STORAGE_OPTIONS_ALLOWED and not name_is_secret(k):
            out[k] = _redact_storage_options(v) if isinstance(v, dict) else v
        else:
            out[k] = REDACTED
    return out


def _worker_env_allowed(name: str) -> bool:
    return str(name).upper().startswith(WORKER_ENV_ALLOWED) and not name_is_secret(name)


_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def _redact_args(args: Any) -> Any:
    """Flags stay; values are redacted unless they are plain numbers (``200``, ``--lr=3e-4``) after a
    flag whose name is not a secret's (``--token 1234`` stays redacted)."""
    if not isinstance(args, list):
        return REDACTED
    out = []
    after_secret = False
    for a in args:
        a = str(a)
        if a.startswith("--"):
            flag, eq, val = a.partition("=")
            secret = name_is_secret(flag.lstrip("-").replace("-", "_"))
            keep = eq and not secret and _NUMBER.fullmatch(val)
            out.append(flag + (f"={val if keep else REDACTED}" if eq else ""))
            after_secret = secret and not eq
        elif a.startswith("-") and len(a) == 2 and not _NUMBER.fullmatch(a):
            out.append(a)  # a short flag such as -v
            after_secret = False
        else:
            out.append(a if _NUMBER.fullmatch(a) and not after_secret else REDACTED)
            after_secret = False
    return out


def redact(key: str, value: Any) -> Any:
    """``value`` of the dotted ``key`` as it may be logged or printed (see the module docstring)."""
    if value in ("", None) or value == [] or value == {}:
        return value
    if key == "checkpoint.storage_options":
        return _redact_storage_options(value)
    if key == "workers.env":
        return {k: (v if _worker_env_allowed(k) else REDACTED) for k, v in value.items()} if isinstance(value, dict) else REDACTED
    if key == "workers.args":
        return _redact_args(value)
    if isinstance(value, dict):
        return {k: redact(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, str) and name_is_secret(key):
        return REDACTED
    return value
