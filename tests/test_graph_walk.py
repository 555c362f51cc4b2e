"""The autograd-graph walks (``torch_hooks``): whose loss a backward is (Note [whose loss]) and
whether a graph holds a compiled function. A node's Python object is made again when its old one was
freed, so a walk that remembered visited nodes by id alone took a later node for a visited one
(Note [autograd nodes known by identity while alive]): on torch 2.11 a model's own loss was found
not to reach its parameters, and the step's loss was never recorded."""
import torch
from torch import nn

from nanscan.monitor.torch_hooks import _graph_nodes, graph_has_compiled_function, graph_reaches


def _branching_chain(x: torch.Tensor, depth: int) -> torch.Tensor:
    # each level has two parents: a walk pushes one and holds the other only on its stack
    y = x
    for _ in range(depth):
        y = y.sin() + y.cos()
    return y.sum()


def test_every_node_of_a_deep_branching_graph_is_visited_once():
    x = torch.randn(3, requires_grad=True)
    loss = _branching_chain(x, 50)
    nodes = list(_graph_nodes(loss.grad_fn))
    # SumBackward, then per level AddBackward + SinBackward + CosBackward, and x's AccumulateGrad
    assert len(nodes) == 1 + 3 * 50 + 1
    assert len({id(n) for n in nodes}) == len(nodes)
    assert sum(type(n).__name__ == "AccumulateGrad" for n in nodes) == 1


def test_a_loss_reaches_the_parameters_at_the_bottom_of_a_deep_graph():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(30)])
    first = model[0][0].weight
    loss = _branching_chain(model(torch.randn(2, 4)), 20)
    assert graph_reaches(loss.grad_fn, frozenset({id(first)}))
    assert graph_reaches(loss.grad_fn, frozenset({id(p) for p in model.parameters()}))
    assert not graph_reaches(loss.grad_fn, frozenset({id(nn.Linear(4, 4).weight)}))
    assert not graph_has_compiled_function(loss.grad_fn)


def test_the_walk_stops_at_its_limit():
    x = torch.randn(3, requires_grad=True)
    assert len(list(_graph_nodes(_branching_chain(x, 50).grad_fn, limit=10))) == 10
