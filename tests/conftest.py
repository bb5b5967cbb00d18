"""Suite-wide settings: one intra-op thread per pytest worker (`make test` runs two workers on two cores)."""

import torch

torch.set_num_threads(1)
