"""The target's answers on disk: the store's format (`store`), what a serving target records of
its traffic (`traffic`), and the index its looked-up branches search (`index`). Generation and
traffic write the store, training reads it; the daemons use it without importing `training/`."""
