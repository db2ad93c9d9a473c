"""Support code, not the paper's: the configuration and its presets, what a run keeps on disk, checkpoints
in and out of the shards, the data and the built-in task with its SFT cold start, the memory plan,
masked statistics and the fast GAE kernels. The paper's own files are at the top level."""
