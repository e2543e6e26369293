"""Models a PyTorch user would bring to dbs, saved as TorchScript for `dbs_worker --model=FILE`.

    /usr/bin/python3 examples/models.py OUT_DIR

writes OUT_DIR/resnet_bn.pt (a small ResNet-style network with BatchNorm for 1x28x28 inputs),
OUT_DIR/plain_cnn.pt (a CNN without BatchNorm), OUT_DIR/wide_cnn.pt (another layout, for
refusal tests) and OUT_DIR/mlp_regression.pt (an MLP regressing one value from 8 features, for
examples/regression_data.py's .npy files). Train one with the local cluster:

    ./deploy/run_local_cluster.sh --model=OUT_DIR/resnet_bn.pt --export_path=trained.pt
    ./deploy/run_local_cluster.sh --model=OUT_DIR/mlp_regression.pt \
        --data=npy:DATA/train_x.npy,DATA/train_y.npy,DATA/test_x.npy,DATA/test_y.npy
"""

import os
import sys

import torch
import torch.nn as nn


class Block(nn.Module):
    """A residual block: conv-bn-relu-conv-bn plus the input."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class ResNetBN(nn.Module):
    """ResNet-style: a stem, two residual blocks at 28x28 and 14x14, global pooling, a head."""

    def __init__(self, classes: int = 10, width: int = 16, channels: int = 1):
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.block1 = Block(width)
        self.pool = nn.MaxPool2d(2)
        self.block2 = Block(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x)))
        x = self.pool(self.block1(x))
        x = self.block2(x)
        return self.head(x.mean(dim=(2, 3)))


class PlainCNN(nn.Module):
    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 5)
        self.fc = nn.Linear(channels * 12 * 12, 10)

    def forward(self, x):
        return self.fc(torch.max_pool2d(torch.relu(self.conv(x)), 2).flatten(1))


class RegressionMLP(nn.Module):
    """Real-valued targets: dbs_worker's --loss=auto picks mean squared error for them."""

    def __init__(self, features: int = 8, hidden: int = 64, outputs: int = 1):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, outputs)

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def resnet_bn(row_shape, num_classes):
    """ResNetBN for a Python worker: `python3 -m dbs.worker --model=models:resnet_bn` (with
    examples/ on PYTHONPATH), the same network as resnet_bn.pt."""
    return ResNetBN(classes=max(num_classes, 1), channels=int(row_shape[0]))


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    torch.jit.script(ResNetBN()).save(os.path.join(out_dir, "resnet_bn.pt"))
    torch.jit.script(ResNetBN(channels=3)).save(os.path.join(out_dir, "resnet_bn_rgb.pt"))
    torch.jit.script(PlainCNN()).save(os.path.join(out_dir, "plain_cnn.pt"))
    torch.jit.script(PlainCNN(channels=12)).save(os.path.join(out_dir, "wide_cnn.pt"))
    torch.jit.script(RegressionMLP()).save(os.path.join(out_dir, "mlp_regression.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
