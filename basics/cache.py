"""Where the project's rebuildable files live: converted models, compiled kernels, features,
indexes. Never the repository."""

import os
import stat
import tempfile
from pathlib import Path


def cache_root(variable: str | None = None, home: str | None = None) -> Path:
    """$DFLASH_SPLIT_CACHE, else ~/.cache/dflash-split; absolute and with `~` expanded: a relative
    or literal-`~` variable put each working directory's files in a cache of its own, the 560 MB
    default model converted again in each (an audit). Without a home (no $HOME and no passwd
    entry, a container's arbitrary user; or HOME empty) a folder of this user's own in the temporary
    directory: Path.home() raised at import, and every command ended in a traceback (an audit)."""
    if variable:
        return Path(variable).expanduser().absolute()
    if home is None:
        home = os.environ.get("HOME")
        home = os.path.expanduser("~") if home is None else home  # the passwd entry's, or "~"
    if not os.path.isabs(home):
        return private_temporary_folder(f"dflash-split-{os.getuid()}")
    return Path(home) / ".cache" / "dflash-split"


def private_temporary_folder(name: str) -> Path:
    """A folder of this user's alone in the temporary directory, made so if new. Its name is
    predictable: one another user made first (or a link) could plant the kernels this process
    loads, so anything but this user's own 0700 folder is refused (a review)."""
    folder = Path(tempfile.gettempdir()) / name
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    found = os.lstat(folder)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise PermissionError(f"{folder} is not a folder of this user's alone: set DFLASH_SPLIT_CACHE or HOME")
    return folder


CACHE_ROOT = cache_root(os.environ.get("DFLASH_SPLIT_CACHE"))
