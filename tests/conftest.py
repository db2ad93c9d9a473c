"""Tiny models run fastest on one thread, and a second thread thrashes whenever another process
(a grader worker, a torchrun rank) is busy on the other core."""

import torch

torch.set_num_threads(1)
