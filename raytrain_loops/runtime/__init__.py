"""The loop wired in one training process without Ray: what a Ray worker and a local run share
(the batch source, the worker's set-up), and local mode (:mod:`.local`). Checkpoints, their files
and restore, are :mod:`raytrain_loops.checkpoint`'s."""
