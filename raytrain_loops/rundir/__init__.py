"""The run directory, below every process that reads or writes it (the driver, a Ray worker, the
Train controller, local mode, the tools): the names of its files and its checkpoints
(:mod:`.layout`), the board where workers post a stop (:mod:`.stops`), the best checkpoints
(:mod:`.best`). Ray-free."""
