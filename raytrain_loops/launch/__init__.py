"""The Ray layer: TorchTrainer from the config, the per-worker loop, sweeps and submission.
It holds no training math (that is :mod:`raytrain_loops.engine`)."""
