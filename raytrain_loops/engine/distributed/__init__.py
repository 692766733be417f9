"""The engine's torch.distributed code: the collectives it runs (``collectives``) and a model made
ready for its workers, sharded by FSDP2 (``sharding``). Each is a no-op, or a plain path, when
no process group is running."""
