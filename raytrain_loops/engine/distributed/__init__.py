"""The engine's torch.distributed code: the collectives it runs (``collectives``), a model made
ready for its workers and sharded by FSDP2 (``sharding``), and the step's DDP/FSDP mechanics
(``step_sync``). Each is a no-op, or a plain path, when no process group is running."""
