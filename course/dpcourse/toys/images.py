"""Generated image-like data: an ImageNet stand-in a 2-core laptop trains on in seconds.

Used by notebook 06, its hidden checks and the torchrun driver (runtime.cluster).

The course never downloads anything, so its image classification task is made
here, from a seed: each image is a grating (stripes) at one of four
orientations, with a random frequency, phase and contrast, plus noise. The
class is the orientation. A small CNN learns it within a few epochs, which is
what the training demos need: a loss that visibly goes down.

Every item is `(image, label, index)`. The index is the sample's number in the
dataset: a training loop that records it can prove which samples each rank
trained on, in which order (how notebook 06 checks a DistributedSampler).
"""

import math

import torch
from torch.utils.data import Dataset

ORIENTATIONS = ("horizontal", "vertical", "diagonal /", "diagonal \\")


class GeneratedImages(Dataset):
    """`n` grayscale `size` x `size` images of oriented stripes; the label is the orientation.

    Deterministic: the same (n, size, seed, noise) always gives the same tensors,
    in every process (ranks build their own copy and agree without talking).
    Tensors are `images` (n, 1, size, size) and `labels` (n,) int64.
    """

    def __init__(self, n, size=12, seed=0, noise=0.6, dtype=torch.float32):
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(len(ORIENTATIONS), (n,), generator=g)
        # the direction the brightness varies along: stripes are perpendicular to it
        angle = torch.tensor([0.0, math.pi / 2, math.pi / 4, -math.pi / 4],
                             dtype=torch.float64)[self.labels]
        frequency = 1.5 + 1.5 * torch.rand(n, generator=g, dtype=torch.float64)  # periods per image
        phase = 2 * math.pi * torch.rand(n, generator=g, dtype=torch.float64)
        contrast = 0.7 + 0.6 * torch.rand(n, generator=g, dtype=torch.float64)
        coords = torch.arange(size, dtype=torch.float64) / size
        y, x = torch.meshgrid(coords, coords, indexing="ij")
        along = (x[None] * torch.sin(angle)[:, None, None] + y[None] * torch.cos(angle)[:, None, None])
        waves = torch.sin(2 * math.pi * frequency[:, None, None] * along + phase[:, None, None])
        pictures = contrast[:, None, None] * waves
        pictures = pictures + noise * torch.randn(n, size, size, generator=g, dtype=torch.float64)
        self.images = pictures[:, None].to(dtype)
        self.classes = len(ORIENTATIONS)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index], index


def show_images(dataset, count=8):
    """A row of the first `count` images with their labels: what the CNN sees."""
    import matplotlib.pyplot as plt

    count = min(count, len(dataset))
    fig, axes = plt.subplots(1, count, figsize=(1.3 * count, 1.6))
    for i, ax in enumerate([axes] if count == 1 else axes):
        image, label, _ = dataset[i]
        ax.imshow(image[0].float(), cmap="gray")
        ax.set_title(f"#{i}: {ORIENTATIONS[int(label)]}", fontsize=8)
        ax.axis("off")
    plt.show()
    return fig
