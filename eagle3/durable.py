"""Durable file writes: whole files appear atomically, or not at all.

Every output of the pipeline is either a whole file (a Parquet shard, a marker, the
manifest) or a stream of records (generation JSONL). Whole files are written to a
temporary name in the same folder, flushed, fsynced and renamed over the target, then
the folder is fsynced so the rename itself survives a power cut. A reader therefore
sees the old file or the new one, never half of either.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from eagle3.errors import UserError


class DiskWriteError(UserError, OSError):
    """A write to the run directory failed (disk full, quota, I/O error), named with its file."""

    def __str__(self) -> str:  # the message alone: it names the file already, "[Errno 28]" adds nothing
        return self.strerror or super().__str__()


@contextlib.contextmanager
def writing(path: str | Path, what: str) -> Iterator[None]:
    """Turn an OSError while writing ``path`` into one clear message naming the file and the disk."""
    try:
        yield
    except DiskWriteError:
        raise
    except OSError as exc:
        folder = Path(path).parent
        free = ""
        try:
            import shutil

            free = f"; {shutil.disk_usage(folder).free / 2**30:.2f} GiB free there"
        except OSError:
            pass
        raise DiskWriteError(
            exc.errno,
            f"{what}: writing {path} failed: {exc.strerror or exc}{free}. Nothing was marked complete; "
            "free space (or move run_dir) and rerun to resume",
        ) from None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- temporaries and their owners ---------------------------------------------------------------
# A temporary next to its target is named ".TARGET.PID@HOST.<random><suffix>". A process killed
# between creating it and the rename (SIGKILL, OOM, power) cannot remove it; the next writer of
# the same target can, once the name says its owner is a process of this host that is gone.
# Temporaries of live processes, of other hosts (a shared run dir) and names without an owner
# are left alone: deleting a file another writer is still filling would be worse than a leak.

_HOST = "".join(c if c.isalnum() or c == "-" else "-" for c in socket.gethostname()) or "host"


def owned_prefix(target: str | Path) -> str:
    """The prefix for a temporary of ``target`` that names this process as its owner."""
    return f".{Path(target).name}.{os.getpid()}@{_HOST}."


_OWNED = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9-]+)\.[^@/]*$")


def _owner(name: str) -> tuple[str, int, str] | None:
    """(target name, pid, host) of a temporary named by owned_prefix, else None."""
    m = _OWNED.match(name)
    return (m["target"], int(m["pid"]), m["host"]) if m else None


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the pid exists
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, under another user
    return False


def _orphans(folder: Path, target: str | None) -> list[Path]:
    pattern = f".{glob.escape(target)}.*@*" if target is not None else ".*@*"
    found = []
    for path in folder.glob(pattern):
        owner = _owner(path.name)
        if owner is not None and target in (None, owner[0]) and owner[2] == _HOST and _gone(owner[1]):
            found.append(path)
    return sorted(found)


def _remove(paths: list[Path]) -> list[Path]:
    removed = []
    for path in paths:
        try:
            if path.is_dir() and not path.is_symlink():
                remove_inside(path, path.parent)
            else:
                path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass  # another writer of the same target got there first
    return removed


def orphaned_temporaries(target: str | Path) -> list[Path]:
    """Temporaries of ``target`` (see owned_prefix) whose owner was a process of this host that is gone."""
    return _orphans(Path(target).parent, Path(target).name)


def remove_orphaned_temporaries(target: str | Path) -> list[Path]:
    """Delete the temporaries ``orphaned_temporaries`` finds (files, links, folders); return them."""
    return _remove(orphaned_temporaries(target))


def sweep_orphaned_temporaries(folder: str | Path) -> list[Path]:
    """Delete the orphaned temporaries of every target in ``folder``; return them. For a writer
    whose target names change between runs (checkpoint steps), so no later write of the same
    name would find them."""
    return _remove(_orphans(Path(folder), None)) if Path(folder).is_dir() else []


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success it is fsynced and renamed onto it.
    Temporaries of the same target left by a killed process are removed first."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_orphaned_temporaries(target)
    fd, tmp_name = tempfile.mkstemp(prefix=owned_prefix(target), suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; outputs are meant to be shared
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(target: str | Path, data: bytes) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def _mapping(obj):
    """JSON for read-only mappings (a stage's typed result reads as its manifest entry)."""
    if isinstance(obj, Mapping):
        return dict(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def atomic_write_json(target: str | Path, obj: Any) -> None:
    atomic_write_bytes(target, (json.dumps(obj, indent=2, sort_keys=True, default=_mapping) + "\n").encode())


def atomic_write_lines(target: str | Path, records: list[dict]) -> None:
    """A JSONL file written whole (for small files such as a stage's rejected rows)."""
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
    atomic_write_bytes(target, text.encode())


def install_file(tmp: str | Path, target: str | Path) -> bool:
    """Move a finished temporary file onto ``target`` durably, unless ``target`` already
    holds the same bytes (then the temp file is dropped and ``target`` keeps its mtime).
    Returns whether ``target`` changed."""
    tmp, target = Path(tmp), Path(target)
    if target.exists() and sha256_file(target) == sha256_file(tmp):
        tmp.unlink()
        return False
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    fsync_dir(target.parent)
    return True


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: str | Path) -> Any:
    """Read a JSON file, naming the file when it is not valid JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


# -- deleting inside the run directory ---------------------------------------------------------
# Every deletion of run-dir content goes through remove_inside: whatever run_dir a config names
# and whatever symlinks sit in the run dir, nothing outside the run dir is ever removed.
# - The root is resolved (run_dir may itself be a symlink, e.g. to a bigger disk). The path's
#   folder is resolved the way the kernel would (symlinks and ".." alike) and the last name is
#   kept as it is, so a symlink is judged by where it sits, never by where it points.
# - A path that is a symlink is unlinked as a link, whatever it points to; a real folder is
#   removed with shutil.rmtree, which on Linux walks by file descriptor and unlinks the symlinks
#   it meets instead of following them.
# - A stage folder symlinked out of the run dir therefore holds nothing remove_inside will touch:
#   put the whole run_dir on the other disk instead.

_SYSTEM_DIRS = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/media",
    "/mnt",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/srv",
    "/sys",
    "/tmp",
    "/usr",
    "/var",
)


class UnsafeDeleteError(UserError, RuntimeError):
    """A deletion would reach outside the run directory (or remove the run directory itself)."""


def unsafe_root_reason(folder: str | Path) -> str | None:
    """Why ``folder`` must not be a run directory (a filesystem root, the home folder or a folder
    holding it, a system folder), or None when it may be one."""
    real = Path(os.path.realpath(os.path.expanduser(str(folder))))
    if real == Path(real.anchor):
        return f"it is the filesystem root {real.anchor!r}"
    home = Path(os.path.realpath(os.path.expanduser("~")))
    if real == home:
        return f"it is the home folder {home}"
    if real in home.parents:
        return f"it holds the home folder {home}"
    if str(real) in _SYSTEM_DIRS:
        return f"it is the system folder {real}"
    return None


def remove_inside(path: str | Path, root: str | Path, *, missing_ok: bool = True, ignore_errors: bool = False) -> bool:
    """Delete ``path`` (a file, a symlink or a folder tree) only when it lies strictly inside
    ``root``; returns whether something was removed.

    Raises UnsafeDeleteError, naming both paths, when ``path`` resolves outside ``root``, is
    ``root`` itself, ends in ``.``/``..``, or when ``root`` is a filesystem root or the home folder.
    ``ignore_errors`` covers OSErrors of the deletion itself, never the refusal."""
    root_real = Path(os.path.realpath(root))
    reason = unsafe_root_reason(root_real)
    if reason is not None:
        raise UnsafeDeleteError(f"refusing to delete {path}: its root {root} is not a safe run directory ({reason})")
    text = os.fspath(path).rstrip(os.sep)
    name = os.path.basename(text)
    if name in ("", ".", ".."):
        raise UnsafeDeleteError(f"refusing to delete {path}: it does not name an entry inside {root}")
    # realpath, not abspath: "link/.." must go where the kernel goes, not where the text suggests
    target = Path(os.path.realpath(os.path.dirname(text) or ".")) / name
    if root_real not in target.parents:
        raise UnsafeDeleteError(
            f"refusing to delete {path} (it is {target}): not strictly inside the run directory {root} (it is "
            f"{root_real}). A stage folder symlinked out of the run dir is not the run's to clean: put the whole "
            "run_dir on that disk instead"
        )
    try:
        if not os.path.lexists(target):
            if missing_ok:
                return False
            raise FileNotFoundError(2, "No such file or directory", str(target))
        if os.path.islink(target) or not os.path.isdir(target):
            os.unlink(target)
        else:
            import shutil

            shutil.rmtree(target)
        return True
    except OSError:
        if ignore_errors:
            return False
        raise


@contextlib.contextmanager
def atomic_folder(target: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``target`` to fill; on success it replaces ``target``
    whole (install_folder), on an error it is removed. Its name, ``.TARGET.PID@HOST.partial``, lets a
    later writer remove it (sweep_orphaned_temporaries) when this process is killed while filling it.
    A link planted under that name is unlinked, never followed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{owned_prefix(target)}partial")
    remove_inside(tmp, target.parent, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        install_folder(tmp, target)
    except BaseException:
        remove_inside(tmp, target.parent, ignore_errors=True)
        raise


def install_folder(tmp: Path, final: Path) -> None:
    """Move a finished temporary folder onto ``final`` (replacing an older one) durably.

    os.replace cannot replace a non-empty folder, so an existing one is first renamed aside;
    a reader sees the old folder, briefly none, or the new one -- never a partial one."""
    for path in tmp.iterdir():
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(tmp)
    old = None
    if os.path.lexists(final):  # a dangling link too: a folder cannot be renamed onto a link
        old = final.with_name(f"{owned_prefix(final)}{time.monotonic_ns()}.old")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        remove_inside(old, final.parent, ignore_errors=True)
