"""Writing the files leanopt's commands make (``convert``'s state_dict, ``compare``'s results and
plots): each file is whole or not there, and a failed write is one line that names its cause.

:func:`write_atomically` writes into a new temporary file in the destination's folder, syncs
it and renames it over the destination: a reader sees the old file or the whole new one, and a
failure leaves no temporary behind. The cause of a failure is read from the ``OSError`` that
the file's ``write()`` raised, even when the writer turned it into something else: torch's zip
writer reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc:672] ...
unexpected pos``, without the errno.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = ["WriteError", "describe", "naming_failures", "write_atomically", "write_text_atomically"]


class WriteError(OSError):
    """A file could not be written; ``str()`` is one line naming the file and the cause."""


# errno -> the words of a one-line message (os.strerror's vary by platform).
_CAUSES = {
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
    errno.ENOENT: "no such folder",
    errno.ENOTDIR: "no such folder",
    errno.EISDIR: "it is a folder",
}


class _Recording:
    """A binary file's ``write``/``flush``/``tell`` that keeps the first ``OSError`` ``write``
    raised. No ``fileno``: a writer that finds one may write to the descriptor from C and report
    a failure without its errno (Pillow does), so every byte goes through ``write`` here."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self._file.flush()

    def tell(self) -> int:
        return self._file.tell()


def write_atomically(dst: str | os.PathLike[str], write: Callable[[Any], None],
                     check: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """``write(f)`` (a binary file-like with ``write``, ``flush`` and ``tell``), then the result
    replaces ``dst`` whole; ``dst`` keeps its old content if anything fails. ``check(path)``,
    if given, reads the written file before it replaces ``dst``: what it raises leaves ``dst``
    as it was.

    A failed write raises :class:`WriteError` (an ``OSError``) with a one-line message, e.g.
    ``cannot write out/optimizer.pt: no space left on /mnt/small (tmpfs, 64.0 KiB, 0 B free)``.
    Anything else ``write`` or ``check`` raises (a ``ValueError``, a bug) is raised as it is.
    """
    dst = os.fspath(dst)
    folder = os.path.dirname(dst) or "."
    tmp = None
    recording = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dst)}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            recording = _Recording(f)
            write(recording)
            f.flush()
            os.fsync(f.fileno())  # a full disk may only say so here (and the rename is then safe)
        if check is not None:
            check(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # the mode open(dst, "w") would give (mkstemp's is 0600)
        os.replace(tmp, dst)
        tmp = None
    except Exception as err:
        cause = recording.error if recording is not None and recording.error is not None else err
        if not isinstance(cause, OSError):
            raise
        raise _failure(dst, cause) from None  # read while the temporary still fills the disk
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@contextlib.contextmanager
def naming_failures(path: str | os.PathLike[str]) -> Iterator[None]:
    """An ``OSError`` in the block (writing ``path`` in place: an appended log) becomes the
    one-line :class:`WriteError` :func:`write_atomically` raises."""
    try:
        yield
    except WriteError:
        raise
    except OSError as err:
        raise _failure(path, err) from None


def _failure(path: str | os.PathLike[str], err: OSError) -> WriteError:
    path = os.fspath(path)
    return WriteError(f"cannot write {path}: {describe(err, os.path.dirname(path) or '.')}")


def write_text_atomically(dst: str | os.PathLike[str], text: str) -> None:
    """:func:`write_atomically` of ``text`` in UTF-8."""
    write_atomically(dst, lambda f: f.write(text.encode("utf-8")))


def describe(err: OSError, folder: str) -> str:
    """The cause of a failed write into ``folder``, in a few words: the filesystem that is full,
    the file size limit that was hit, or the errno's meaning."""
    if err.errno == errno.ENOSPC:
        return f"no space left on {_device(folder)}"
    if err.errno == errno.EFBIG:
        try:
            import resource  # POSIX only
        except ImportError:
            return f"file too large for {_device(folder)}"
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft != resource.RLIM_INFINITY:
            return f"file too large: this process may write files of at most {soft:,} bytes (ulimit -f)"
        return f"file too large for {_device(folder)}"
    return _CAUSES.get(err.errno or 0) or (err.strerror or str(err) or type(err).__name__).lower()


def _device(folder: str) -> str:
    """``"/mnt/small (tmpfs, 64.0 KiB, 0 B free)"``: the mount point that holds ``folder``, its
    filesystem type where /proc/mounts says, its size and what is free."""
    path = os.path.realpath(folder)
    while not os.path.ismount(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    facts = []
    with contextlib.suppress(OSError):
        with open("/proc/mounts") as mounts:  # the last entry of a mount point is the one in effect
            types = [f[2] for f in (line.split() for line in mounts) if len(f) > 2 and f[1] == path]
        if types:
            facts.append(types[-1])
    with contextlib.suppress(OSError):
        usage = shutil.disk_usage(folder)
        facts += [_size(usage.total), f"{_size(usage.free)} free"]
    return f"{path} ({', '.join(facts)})" if facts else path


def _size(n: float) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"
