"""What of the host a sandbox sees: standard system dirs and the runtimes, read-only; nothing else.

Visible: /usr, /bin, /sbin, /lib*, /etc (minus secrets), the Python interpreter's prefix,
the active virtualenv (pytest, harness CLIs under ``<venv>/npm``), node's prefix and any
``visible_paths`` the caller adds. Not visible: /home, /root (except the interpreter's
prefix), /work, /srv, /mnt, /var, the host's /tmp and /run, /sys. ``hide_paths`` that fall
inside a visible dir are covered with an empty tmpfs (dirs) or /dev/null (files).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

STANDARD_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Host secrets under /etc never shown (covered even though /etc is visible).
ETC_SECRETS = (
    "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssh", "/etc/ssl/private",
    "/etc/sudoers", "/etc/sudoers.d", "/etc/security/opasswd", "/etc/krb5.keytab", "/etc/docker",
    "/etc/netrc", "/etc/pki/private",
)  # fmt: skip
# Credentials under a user's home, in case a visible path lies below one.
HOME_SECRETS = (
    ".ssh", ".aws", ".azure", ".gnupg", ".docker", ".kube", ".netrc", ".git-credentials", ".config",
    ".cache/huggingface", ".huggingface",
)  # fmt: skip


def _prefix_of(binary: str | None) -> Path | None:
    if not binary:
        return None
    real = Path(os.path.realpath(binary))
    return real.parent.parent  # <prefix>/bin/<binary>


@functools.cache
def runtime_paths() -> tuple[Path, ...]:
    """Interpreter prefix, virtualenv and node prefix of this host (resolved)."""
    out: list[Path] = [Path(os.path.realpath(sys.base_prefix)), Path(os.path.realpath(sys.prefix))]
    exe_prefix = _prefix_of(sys.executable)
    if exe_prefix is not None:
        out.append(exe_prefix)
    for binary in ("node", "git", "bash"):
        p = _prefix_of(shutil.which(binary))
        if p is not None:
            out.append(p)
    return tuple(out)


def _covered(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def visible_paths(extra: Iterable[Path | str] = ()) -> list[Path]:
    """Host paths bound read-only, outermost only (a path inside another is dropped)."""
    return list(_visible_paths(tuple(str(p) for p in extra)))


@functools.lru_cache(maxsize=64)
def _visible_paths(extra: tuple[str, ...]) -> tuple[Path, ...]:
    candidates = [Path(p) for p in STANDARD_DIRS]
    candidates += [Path(os.path.realpath(p)) for p in (*runtime_paths(), *extra)]
    out: list[Path] = []
    for p in sorted(set(candidates), key=lambda p: (len(p.parts), str(p))):
        if p == Path("/") or not os.path.lexists(p):
            continue
        if not _covered(p, [q for q in out if not q.is_symlink()]):
            out.append(p)
    return tuple(out)


def hidden_inside(paths: Iterable[Path | str], visible: list[Path]) -> list[Path]:
    """The hide paths (and default secrets) that lie inside a visible path, resolved."""
    roots = tuple(v for v in visible if not v.is_symlink())
    out = list(_default_hidden(roots))
    for p in map(Path, paths):
        p = Path(os.path.realpath(p))
        if p not in out and os.path.lexists(p) and _covered(p, roots):
            out.append(p)
    return out


@functools.lru_cache(maxsize=16)
def _default_hidden(roots: tuple[Path, ...]) -> tuple[Path, ...]:
    home = Path.home()
    out: list[Path] = []
    for p in (*map(Path, ETC_SECRETS), *(home / s for s in HOME_SECRETS)):
        p = Path(os.path.realpath(p))
        if os.path.lexists(p) and _covered(p, roots) and p not in out:
            out.append(p)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _host_accounts() -> tuple[str, str] | None:
    try:
        return Path("/etc/passwd").read_text(), Path("/etc/group").read_text()
    except OSError:
        return None


def passwd_lines(uid: int, gid: int) -> tuple[str, str] | None:
    """/etc/passwd and /etc/group contents naming the sandbox uid (None when the host has it)."""
    if (accounts := _host_accounts()) is None:
        return None
    passwd, group = accounts
    if any(line.split(":")[2:3] == [str(uid)] for line in passwd.splitlines()):
        return None
    passwd = passwd.rstrip("\n") + f"\nsandbox:x:{uid}:{gid}:legorl sandbox:/tmp:/bin/bash\n"
    group = group.rstrip("\n") + f"\nsandbox:x:{gid}:\n"
    return passwd, group
