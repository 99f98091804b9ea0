"""The target side: the model adapter (model/), its engine (engine/), the decoding algorithm
(decoding/), what drafting needs of the target (drafting/) and the daemon (serving/)."""

from basics.cache import CACHE_ROOT

__all__ = ["CACHE_ROOT"]
