"""The loop wired in one training process without Ray: what a Ray worker and a local run share
(the batch source, the reporter's checkpoint files and restore, the worker's set-up), and local
mode (:mod:`.local`)."""
