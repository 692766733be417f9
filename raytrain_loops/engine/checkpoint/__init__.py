"""Checkpoint files and their I/O: atomic, verifiable files read without unpickling code
(:mod:`.files`), and ``torch.distributed.checkpoint`` shards read the same way (:mod:`.dcp_io`)."""
