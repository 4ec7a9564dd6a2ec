"""Parameter shapes of well-known models, written out from their architecture (nothing downloaded).

``resnet18_cifar_shapes``: the ResNet-18 that PowerSGD's paper trains on CIFAR-10 (Vogels et al.
2019, the ``paper-code`` of github.com/epfml/powersgd): a 3x3 stem of 64 channels without max-pool,
four stages of two basic blocks (64, 128, 256, 512 channels; stride 2 from the second stage on),
a 1x1 convolution with batch norm on each shortcut that changes shape, and a 512 -> 10 linear layer.
Convolutions have no bias; every batch norm has a weight and a bias.
"""

from course_lib.utils import checks

__all__ = ["resnet18_cifar_shapes"]


def resnet18_cifar_shapes(num_classes: int = 10) -> list[tuple[str, tuple[int, ...]]]:
    """``[(name, shape), ...]`` of every trainable parameter, in the model's order."""
    checks.integer("num_classes", num_classes, 1)
    shapes = [("conv1.weight", (64, 3, 3, 3)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    in_planes = 64
    for stage, (planes, stride) in enumerate([(64, 1), (128, 2), (256, 2), (512, 2)], start=1):
        for block in range(2):
            name = f"layer{stage}.{block}"
            shapes += [(f"{name}.conv1.weight", (planes, in_planes, 3, 3)),
                       (f"{name}.bn1.weight", (planes,)), (f"{name}.bn1.bias", (planes,)),
                       (f"{name}.conv2.weight", (planes, planes, 3, 3)),
                       (f"{name}.bn2.weight", (planes,)), (f"{name}.bn2.bias", (planes,))]
            if (stride if block == 0 else 1) != 1 or in_planes != planes:
                shapes += [(f"{name}.shortcut.0.weight", (planes, in_planes, 1, 1)),
                           (f"{name}.shortcut.1.weight", (planes,)), (f"{name}.shortcut.1.bias", (planes,))]
            in_planes = planes
    shapes += [("linear.weight", (num_classes, 512)), ("linear.bias", (num_classes,))]
    return shapes
