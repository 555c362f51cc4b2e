"""Models for the capture / replay tests and the CLI (``--model tests.capture_models:drop_net``)."""
import torch
from torch import nn

POISON = 3e38  # finite in float32; dropout's 1 / (1 - p) = 2 scaling turns it into +inf when kept


class DropNet(nn.Module):
    """NaN only when dropout *keeps* the poisoned element: 2 * 3e38 = inf, sin(inf) = NaN."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.act = Sine()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.act(self.drop(x)))


class Sine(nn.Module):
    def forward(self, x):
        return torch.sin(x)


def drop_net():
    torch.manual_seed(0)
    return DropNet(), lambda model, batch: model(batch).pow(2).mean()


class LogNet(nn.Module):
    """A functional fault inside a module: log of a negative in ``block``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.block = LogBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


class LogBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.log(self.lin(x) - 100.0)


def log_net():
    torch.manual_seed(0)
    return LogNet()
