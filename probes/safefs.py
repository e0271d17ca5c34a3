"""Safe file operations for run directories on shared filesystems: probes and outputs alike.

The threat: run directories are often group-writable, and another user who can write there can
swap any name for a symlink, a FIFO or a device between two of our calls; a careless user can
plant the same by mistake. The rules here:

- A directory is opened once (`SafeDir.open` / `SafeDir.subdir`): checked to be a real directory
  (a symlink at the last component is refused for directories the tool creates) and, for those,
  owned by the current user. Every name inside is then used relative to that descriptor, so
  renaming or replacing the directory afterwards cannot redirect a write.
- New files are written inside a private 0700 temp directory (nobody else can touch its
  entries) and renamed into place; modes are set on the open descriptor, respecting the umask.
- Logs are opened for append with O_NOFOLLOW and must be regular files we own.
- Control files are read only when they are regular files under a small size cap, opened
  non-blocking (a FIFO cannot stall the reader), read with a bounded read.

Linux (and other POSIX systems with `dir_fd` support) only; this module imports nothing but
the standard library, because the probes load it inside the user's job.
"""
from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = os.O_NOFOLLOW
TMP_SUFFIX = ".tmp"


Data = bytes | Callable[[], Iterable[bytes]]
"""What a file is written from: its bytes, or a function that gives them in pieces."""


class UnsafePath(OSError):
    """A name in a run directory is not what the tool may safely use (symlink, FIFO, foreign owner...)."""


class TempSwapped(UnsafePath):
    """Our fresh temp directory was replaced by someone else's before we opened it."""


def umask() -> int:
    """The process umask, read without changing it (os.umask would race with other threads)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # no /proc: the classic dance (rare platforms)
    os.umask(old)
    return old


def _describe(mode: int) -> str:
    for test, word in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return word
    return "not a regular file"


def shared_warning(st: os.stat_result, label: str) -> str | None:
    """A line for a directory others may write to without the sticky bit (they can swap names)."""
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        who = "everyone" if st.st_mode & stat.S_IWOTH else "its group"
        return (f"{label}: writable by {who} without the sticky bit: other users can replace files in it "
                "(diagnose writes safely there, but consider chmod o-w,g-w or +t)")
    return None


class SafeDir:
    """An open directory; names inside are resolved relative to its descriptor, never by path again."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path
        self.warning: str | None = None

    # ---- opening -------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, *, create: bool = True, strict: bool = True) -> SafeDir:
        """Open (and create) a directory.

        strict: the tool's own directory: a symlink at the last component is refused and the
        directory must belong to the current user. Not strict: a path the user named (it may be
        a symlink they made, a team directory another member owns); it is still opened once and
        used through its descriptor.
        """
        path = Path(path)
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(path)
            except FileExistsError:
                pass
        fd = _open_dir(path, None, strict)
        d = cls(fd, path)
        d.warning = shared_warning(os.fstat(fd), str(path))
        return d

    def subdir(self, name: str, *, create: bool = True) -> SafeDir:
        """A directory inside this one, always strict: never through a symlink, ours only."""
        _check_name(name)
        if create:
            try:
                os.mkdir(name, dir_fd=self.fd)
            except FileExistsError:
                pass
        return SafeDir(_open_dir(name, self.fd, True, self.path / name), self.path / name)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading -------------------------------------------------------------------
    def lstat(self, name: str) -> os.stat_result | None:
        """The entry itself (a symlink is not followed); None when absent."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def read_small(self, name: str, max_bytes: int) -> bytes | None:
        """A control file's bytes; None when absent. Raises UnsafePath for anything but a regular
        file of at most max_bytes (a FIFO, a symlink to /dev/zero, a huge file)."""
        _check_name(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            st = self.lstat(name)
            raise UnsafePath(f"{self.path / name}: {_describe(st.st_mode) if st else exc.strerror}, "
                             "not a regular file") from None
        try:
            return _read_bounded(fd, self.path / name, max_bytes)
        finally:
            os.close(fd)

    # ---- writing -------------------------------------------------------------------
    def write_atomic(self, name: str, data: Data, mode: int = 0o644) -> None:
        """Replace `name` with `data` in one rename: a reader sees the old file or the new one.
        `data`: the bytes, or a function giving them in pieces (called again on a retry), so that
        an output larger than what makes it need never be held whole (diagnose/output.py)."""
        _check_name(name)
        for attempt in range(3):
            try:
                with self.private_tmp(name) as tmp:
                    tmp.write_new(name, data, mode)
                    tmp.publish(name, name)
                return
            except (FileNotFoundError, TempSwapped):
                # in a directory others may write to (no sticky bit), someone can rename our fresh
                # temp directory away, or put their own in its place before we open it: nothing was
                # written through it (we refuse theirs). A new temp directory, a few times, then
                # the error.
                if attempt == 2:
                    raise

    def open_append(self, name: str, buffering: int = -1):
        """A text log opened for append: created if absent, never through a symlink, ours only."""
        _check_name(name)
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=self.fd)  # O_NONBLOCK: opening a planted FIFO fails instead of waiting
        try:
            _check_regular_owned(os.fstat(fd), self.path / name)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "a", buffering=buffering)

    def replace(self, src: str, dst: str) -> None:
        _check_name(src)
        _check_name(dst)
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def private_tmp(self, label: str) -> PrivateTmp:
        """A fresh 0700 directory inside this one (hidden name: never read as a trace)."""
        name = f".{label}.{secrets.token_hex(6)}{TMP_SUFFIX}"
        os.mkdir(name, 0o700, dir_fd=self.fd)
        try:
            fd = _open_dir(name, self.fd, True, self.path / name)
        except UnsafePath as exc:
            _rmdir_quietly(name, self.fd)
            # between our mkdir and open someone put their own entry in its place
            raise TempSwapped(str(exc)) from None
        except BaseException:
            _rmdir_quietly(name, self.fd)
            raise
        return PrivateTmp(fd, self.path / name, self, name)

    def remove_private_tmps(self, prefix: str) -> None:
        """Drop the temp directories (and stray temp files) a write interrupted by a signal left."""
        try:
            names = os.listdir(self.fd)
        except OSError:
            return
        for name in names:
            if not name.startswith(f".{prefix}"):
                continue
            st = self.lstat(name)
            if st is None or st.st_uid != os.geteuid():
                continue
            try:
                if stat.S_ISDIR(st.st_mode):
                    with SafeDir(_open_dir(name, self.fd, True, self.path / name), self.path / name) as d:
                        d._clear()
                    os.rmdir(name, dir_fd=self.fd)
                elif stat.S_ISREG(st.st_mode):
                    os.unlink(name, dir_fd=self.fd)
            except OSError:
                continue

    def fd_path(self, name: str) -> str:
        """A path for code that only takes paths (the profiler's C++ exporter): through
        /proc/self/fd it names this very directory, whatever happens to its path meanwhile."""
        proc = f"/proc/self/fd/{self.fd}"
        return f"{proc}/{name}" if os.path.isdir(proc) else str(self.path / name)

    def _clear(self) -> None:
        for name in os.listdir(self.fd):
            try:
                os.unlink(name, dir_fd=self.fd)
            except OSError:
                pass


class PrivateTmp(SafeDir):
    """A private temp directory: write new files, rename them into the parent, removed on exit."""

    def __init__(self, fd: int, path: Path, parent: SafeDir, name: str) -> None:
        super().__init__(fd, path)
        self.parent = parent
        self.name = name

    def write_new(self, name: str, data: Data, mode: int = 0o644) -> None:
        with self.open_new(name, mode) as f:
            for part in ((data,) if isinstance(data, bytes) else data()):
                f.write(part)

    def open_new(self, name: str, mode: int = 0o644):
        """A new binary file here (exclusive, no symlink), its mode set on the descriptor."""
        _check_name(name)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            os.fchmod(fd, mode & ~umask())
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "wb")

    def open_read(self, name: str):
        _check_name(name)
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            _check_regular_owned(os.fstat(fd), self.path / name)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    def publish(self, name: str, final: str) -> None:
        """Rename `name` from here to `final` in the parent (replacing it: one atomic step)."""
        _check_name(final)
        os.replace(name, final, src_dir_fd=self.fd, dst_dir_fd=self.parent.fd)

    def __exit__(self, *exc) -> None:
        try:
            self._clear()
        finally:
            self.close()
            _rmdir_quietly(self.name, self.parent.fd)


def write_atomic(path: str | Path, data: Data, mode: int = 0o644) -> None:
    """Write `path` via a private temp directory and one rename. The directory is the one the
    user named (not strict: it may be a link they made or a team directory)."""
    path = Path(path)
    with SafeDir.open(path.parent, create=True, strict=False) as d:
        d.write_atomic(path.name, data, mode)


def read_regular(path: str | Path, max_bytes: int) -> bytes:
    """A sidecar or control file the analysis reads: regular file only (a FIFO, device or
    symlink to one raises UnsafePath), at most max_bytes (else UnsafePath), bounded read."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return _read_bounded(fd, path, max_bytes)
    finally:
        os.close(fd)


def open_regular(path: str | Path):
    """A binary reader for a large sidecar (step logs): regular files only, opened non-blocking."""
    fd = os.open(Path(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path}: {_describe(st.st_mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


# ---- helpers ----------------------------------------------------------------------------
def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise UnsafePath(f"{name!r}: not a plain file name")


def _open_dir(name, dir_fd: int | None, strict: bool, label: Path | None = None) -> int:
    label = label if label is not None else Path(name)
    flags = _DIR_FLAGS | (_NOFOLLOW if strict else 0)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            raise exc from None
        raise UnsafePath(f"{label}: {_describe(st.st_mode)}, not a directory the tool may write into") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePath(f"{label}: not a directory")
        if strict and st.st_uid != os.geteuid():
            raise UnsafePath(f"{label}: owned by uid {st.st_uid}, not by the current user (planted by someone "
                             "else?)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular_owned(st: os.stat_result, label: Path) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{label}: {_describe(st.st_mode)}, not a regular file")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{label}: owned by uid {st.st_uid}, not by the current user")


def _read_bounded(fd: int, label: Path, max_bytes: int) -> bytes:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{label}: {_describe(st.st_mode)}, not a regular file")
    if st.st_size > max_bytes:
        raise UnsafePath(f"{label}: {st.st_size} bytes, larger than the {max_bytes}-byte limit")
    chunks, total = [], 0
    while total <= max_bytes:
        b = os.read(fd, max_bytes + 1 - total)
        if not b:
            break
        chunks.append(b)
        total += len(b)
    if total > max_bytes:  # grew while we read
        raise UnsafePath(f"{label}: larger than the {max_bytes}-byte limit")
    return b"".join(chunks)


def _rmdir_quietly(name: str, dir_fd: int) -> None:
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:
        pass
