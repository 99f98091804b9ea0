"""Where the project's rebuildable files live: converted models, compiled kernels, features,
indexes. Never the repository."""

import os
from pathlib import Path

# `or`, not get's default: Path.home() raises where there is no HOME, which the variable spares.
# Absolute and with `~` expanded: a relative or literal-`~` $DFLASH_SPLIT_CACHE put each working
# directory's files in a cache of its own, the 560 MB default model converted again in each (an
# audit), where the kernels' cache, alone made absolute, did not.
CACHE_ROOT = (
    Path(os.environ.get("DFLASH_SPLIT_CACHE") or Path.home() / ".cache" / "dflash-split").expanduser().absolute()
)
