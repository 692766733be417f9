"""The engine's torch.distributed code: the collectives it runs (``collectives``), a model made
ready for its workers and sharded by FSDP2 (``sharding``), and how a group trains one model alone,
with DDP or with FSDP2 (``strategy``). Each is a no-op, or a plain path, when no process group is
running."""
