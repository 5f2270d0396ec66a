"""The code a run runs: the state of the git repository holding it (`git_info`).

`code_id` (the commit, plus a hash of the uncommitted diff) is part of a run's
id (`cadence.run.rundir`); `metadata/git.yaml` records the rest.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import attrs

CODE_DIR_ENV = "CADENCE_CODE_DIR"
"""Environment variable naming the directory whose git repository is the run's code (default: cwd)."""
SHORT_SHA_LENGTH = 7  # fixed, unlike `git rev-parse --short`, so a commit's code_id never changes


@attrs.frozen
class GitInfo:
    """The state of the git repository holding the code being run."""

    root: str
    sha: str
    branch: str | None
    remote: str | None
    commit_time: str
    diff: bytes = attrs.field(repr=False)
    untracked: tuple[str, ...] = ()

    @property
    def dirty(self) -> bool:
        """Tracked files differ from HEAD (staged or not); untracked files do not count."""
        return bool(self.diff)

    @property
    def code_id(self) -> str:
        short = self.sha[:SHORT_SHA_LENGTH]
        return f"{short}-d{hashlib.sha256(self.diff).hexdigest()[:10]}" if self.diff else short

    def to_yaml_dict(self, timestamp: str) -> dict[str, Any]:
        return {
            "available": True, "code_id": self.code_id, "sha": self.sha, "branch": self.branch,
            "remote": self.remote, "dirty": self.dirty, "commit_time": self.commit_time,
            "diff_sha256": hashlib.sha256(self.diff).hexdigest() if self.diff else None,
            "untracked_files": len(self.untracked), "untracked": list(self.untracked[:100]),
            "root": self.root, "timestamp": timestamp,
        }  # fmt: skip


def code_directory() -> Path:
    """Where the run's code is looked for: `$CADENCE_CODE_DIR`, else the current directory."""
    return Path(os.environ.get(CODE_DIR_ENV) or os.getcwd())


def _git(args: list[str], cwd: Path) -> bytes | None:
    # No optional locks: reading the status must not take index.lock from the user's own git.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0"}
    try:
        done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _public_url(url: str) -> str:
    """A remote URL without credentials (`https://token@host/x` -> `https://host/x`)."""
    return re.sub(r"^([a-z][a-z0-9+.-]*://)[^/@]*@", r"\1", url, flags=re.IGNORECASE)


def git_info(directory: str | os.PathLike[str] | None = None) -> GitInfo | None:
    """Git metadata of the repository containing `directory` (default `code_directory()`).

    Returns None outside a repository, in one without commits, or without `git`.

    Example:
        >>> info = git_info(".")
        >>> info is None or len(info.sha) == 40
        True
    """
    where = Path(directory) if directory is not None else code_directory()
    if not where.is_dir() or (root := _git(["rev-parse", "--show-toplevel"], where)) is None:
        return None
    head = _git(["-c", "log.showSignature=false", "log", "-1", "--format=%H%n%cI"], where)
    if head is None:  # a repository without commits
        return None
    sha, commit_time = head.decode().split("\n")[:2]
    branch = _git(["symbolic-ref", "-q", "--short", "HEAD"], where)
    remotes = {}
    for line in (_git(["config", "--get-regexp", r"^remote\..*\.url$"], where) or b"").decode().splitlines():
        key, _, url = line.partition(" ")  # remote.<name>.url <url>
        remotes[key[len("remote.") : -len(".url")]] = url
    remote = remotes.get("origin") or next(iter(remotes.values()), None)
    # Fixed diff options so the user's git config (external diff, prefixes, renames) cannot change the hash.
    diff_args = ["-c", "core.quotepath=off", "diff", "--no-color", "--no-ext-diff", "--no-renames", "--binary"]
    diff = _git([*diff_args, "--src-prefix=a/", "--dst-prefix=b/", "HEAD"], where) or b""
    untracked = (_git(["ls-files", "--others", "--exclude-standard", "-z"], where) or b"").decode(errors="replace")
    return GitInfo(
        root=root.decode().strip(), sha=sha.strip(), branch=branch.decode().strip() if branch else None,
        remote=_public_url(remote) if remote else None, commit_time=commit_time.strip(), diff=diff,
        untracked=tuple(sorted(name for name in untracked.split("\0") if name)),
    )  # fmt: skip
