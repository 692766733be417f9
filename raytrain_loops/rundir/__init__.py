"""The run directory, below every process that reads or writes it (the driver, a Ray worker, the
Train controller, local mode, the tools): the names of its files (:mod:`.layout`), the board where
workers post a stop (:mod:`.stops`). Its checkpoints are :mod:`raytrain_loops.checkpoint`'s.
Ray-free."""
