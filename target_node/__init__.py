"""The target side: the model adapter (model/), its engine (engine/), the decoding algorithm
(decoding/), what drafting needs of the target (drafting/) and the daemon (serving/)."""

import os
from pathlib import Path

# Where converted models, compiled kernels, features and other rebuildable files live: never the repo.
# `or`, not get's default: Path.home() raises where there is no HOME, which the variable spares.
CACHE_ROOT = Path(os.environ.get("DFLASH_SPLIT_CACHE") or Path.home() / ".cache" / "dflash-split")
