"""Where the agent keeps its runtime state (control socket, workers' metrics files), and the checks
that make that place private.

The control socket's file mode is its authentication, so the directory around it must belong to
the agent's user and must not be writable by anyone else: a directory another local user created
first (``/tmp`` is shared) could hold a socket of theirs under our name. Resolution of the default
(``agent.state_dir`` empty):

1. ``$RUNTIME_DIRECTORY`` — systemd's ``RuntimeDirectory=`` (``/run/trainguard`` for the shipped unit);
2. ``$XDG_RUNTIME_DIR/trainguard`` — the per-user runtime dir a login session has (``/run/user/<uid>``),
   used only when it exists and belongs to this user;
3. ``/tmp/trainguard-<uid>/state``, the base created ``0700``.

:func:`ensure_private_dir` creates what is missing with mode ``0700`` and refuses (a
:class:`~trainguard.contract.configbase.ConfigError` naming ``agent.state_dir``) a path that is a
symlink, not a directory, owned by another user, or writable by group or others.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping

from trainguard.contract.configbase import ConfigError

STATE_KEY = "agent.state_dir"


def private_base(uid: int | None = None) -> str:
    """``/tmp/trainguard-<uid>``: the per-user base of ``trainguard run``'s state and logs."""
    return os.path.join(tempfile.gettempdir(), f"trainguard-{os.getuid() if uid is None else uid}")


def _usable_xdg(env: Mapping[str, str]) -> str | None:
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if not xdg or not os.path.isabs(xdg):
        return None
    try:
        st = os.lstat(xdg)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return None
    return xdg


def default_state_dir(env: Mapping[str, str]) -> str:
    """The default ``agent.state_dir`` for this process (see the module docstring)."""
    runtime_directory = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime_directory and os.path.isabs(runtime_directory):
        return runtime_directory
    xdg = _usable_xdg(env)
    if xdg:
        return os.path.join(xdg, "trainguard")
    return os.path.join(private_base(), "state")


def candidate_state_dirs(env: Mapping[str, str]) -> list[str]:
    """Every place an agent of this user (or the system service) may keep its sockets, in the order
    ``trainguard drain``/``status`` look; existing directories only."""
    out = [default_state_dir(env), "/run/trainguard"]
    xdg = _usable_xdg(env)
    if xdg:
        out.append(os.path.join(xdg, "trainguard"))
    out += [os.path.join(private_base(), "state"), "/var/lib/trainguard"]
    seen: list[str] = []
    for d in out:
        if d not in seen and os.path.isdir(d):
            seen.append(d)
    return seen


def check_private(path: str, *, key: str = STATE_KEY, st: os.stat_result | None = None) -> None:
    """Refuse ``path`` unless it is a real directory of this user that nobody else can write."""
    try:
        st = st or os.lstat(path)
    except FileNotFoundError:
        raise ConfigError(key, f"{path} does not exist", "create it, or leave the setting empty for the default") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(key, f"{path} is a symbolic link", "point the setting at the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(key, f"{path} is not a directory", "remove it or choose another directory")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise ConfigError(key, f"{path} belongs to uid {st.st_uid}, not to this user (uid {uid}): another user may "
                          "have created it to take over the control socket", f"remove {path} (as its owner) or choose "
                          "a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(key, f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                          f"chmod go-w {path}, or choose a private directory")


def _check_anchor(path: str, key: str) -> None:
    """The existing directory new ones are created under: owned by this user or root, and not
    writable by others unless sticky (``/tmp``), or whoever can write it could swap our directory."""
    st = os.stat(path)
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(key, f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}) or root",
                          "choose a directory under one of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(key, f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                          "choose a directory under one of your own")


def ensure_private_dir(path: str, *, key: str = STATE_KEY) -> str:
    """Create ``path`` (and missing parents) with mode ``0700`` under a safe existing directory and
    check every level created here, and ``path`` itself, with :func:`check_private`. Returns ``path``."""
    path = os.path.abspath(path)
    missing: list[str] = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if missing:
        _check_anchor(p, key)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)  # fails if someone created it in between: then it is checked below
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(key, f"cannot create {d}: {e.strerror or e}",
                              "choose a directory this user can create, or create it first") from None
        check_private(d, key=key)
    check_private(path, key=key)
    base = private_base()
    if path.startswith(base + os.sep) and os.path.isdir(base):
        check_private(base, key=key)  # the shared-/tmp base of the default: ours, or refused
    return path
