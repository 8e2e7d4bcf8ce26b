"""Building blocks for typed config sections.

Every component owns one ``@dataclass(kw_only=True, slots=True)`` section with a docstring under
each field and cross-field checks in ``__post_init__`` (the torchtitan pattern). A check raises
:class:`FieldError` naming the *field*; the loader (:mod:`trainguard.agent.config`) knows where the
section sits and rewrites it into a :class:`ConfigError` that names the YAML key, the environment
variable and the fix. Components never read ``os.environ``: only the loader does.
"""

from __future__ import annotations

from typing import Any

ENV_PREFIX = "TRAINGUARD_"


class FieldError(ValueError):
    """A section-level validation failure: which field, what is wrong, how to fix it."""

    def __init__(self, field: str, message: str, fix: str) -> None:
        super().__init__(f"{field}: {message}. Fix: {fix}")
        self.field = field
        self.message = message
        self.fix = fix


class ConfigError(ValueError):
    """A user-facing configuration error naming the YAML key, the env var and the fix."""

    def __init__(self, key: str, message: str, fix: str, *, value: Any = None, source: str = "") -> None:
        self.key = key
        self.env_var = env_var_for(key)
        self.message = message
        self.fix = fix
        self.value = value
        self.source = source
        where = f" (from {source})" if source else ""
        shown = "" if value is None else f" = {value!r}"
        super().__init__(
            f"invalid config `{key}`{shown}{where}: {message}. "
            f"Set YAML key `{key}` or env var {self.env_var}. Fix: {fix}"
        )


def env_var_for(key: str) -> str:
    """``checkpoint.keep_last`` -> ``TRAINGUARD_CHECKPOINT_KEEP_LAST``.

    Section names contain no underscore, so the first ``_`` after the prefix always ends the
    section name and the mapping is reversible.
    """
    return ENV_PREFIX + key.replace(".", "_").upper()


def require(cond: bool, field: str, message: str, fix: str) -> None:
    """Raise :class:`FieldError` unless ``cond`` holds."""
    if not cond:
        raise FieldError(field, message, fix)


SECRET_MARKERS = ("secret", "password", "token", "key_id", "access_key", "credentials")


def is_secret(key: str) -> bool:
    """Whether a (possibly dotted) key holds a secret that must never be logged."""
    leaf = key.rsplit(".", 1)[-1].lower()
    return any(m in leaf for m in SECRET_MARKERS)
