"""A backward pass in two: the input's gradient now, the weights' gradient later (ZB-H1's B and W).

Zero-bubble pipelines (Qi et al., 2023) run a stage's backward as two passes: B, the gradient of
the stage's input, which the previous stage is waiting for, and W, the gradient of its weights,
which nobody waits for and can fill what would be idle time. Both are plain autograd; the cut
is found on the micro-batch's graph:

- the graph's nodes that lead to the input ("input-side"); the nodes that lead to a weight but
  not to the input ("weight-side": a weight's AccumulateGrad, and the transposes or views that
  feed it);
- a boundary node is an input-side node with a weight-side child: a matmul's backward, say,
  whose one output feeds the input's gradient and whose other feeds the weight's.

B runs autograd from the output to the input only: the engine computes no output that leads to
no input, so no weight gradient is formed, and a pre-hook on each boundary node keeps the
gradient it received. W runs each boundary node again from that kept gradient, towards its own
weights only (`torch.autograd.backward` on gradient edges, `inputs=` the weights): the
engine then computes just the weight-side outputs. Every kernel is the one a whole backward
runs, on the same values, so the gradients are bit for bit those of `out.backward(grad)`
(`tests/test_pipeline_schedules.py` checks). The weights' AccumulateGrad runs as usual, so
gradient hooks (data parallel's) fire in W.

Boundary nodes that reach a common weight (one weight used at two depths of the stage) go in one
W call, each fed its kept gradient by a pre-hook; the engine then also walks the input-side path
between them, whose gradients the hooks overwrite, so nothing is counted twice.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


class DeferredWeights:
    """The weight gradients of one micro-batch's backward, to be run later: boundary nodes in
    groups, each group with the weights it reaches, and the gradients each node received."""

    def __init__(self, groups: list[tuple[list[Node], list[nn.Parameter]]], kept: dict) -> None:
        self.groups, self.kept = groups, kept

    def run(self) -> None:
        """Accumulate the weights' gradients into their `.grad`; lets go of the graph."""
        for nodes, params in self.groups:
            kept = [
                (n, k, g)
                for n in nodes
                for k, g in enumerate(self.kept.get(n, ()))
                if g is not None
            ]
            if not kept:
                continue
            edges = [GradientEdge(n, k) for n, k, _ in kept]
            grads = [g for _, _, g in kept]
            hooks = []
            if len(nodes) > 1:  # one weight at two depths: each node gets what it kept
                hooks = [n.register_prehook(_replace_with(self.kept.get(n))) for n in nodes]
            try:
                torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
            finally:
                for h in hooks:
                    h.remove()
        self.groups, self.kept = [], {}


NOTHING_DEFERRED = DeferredWeights([], {})


def _replace_with(grads: tuple | None):
    """A node pre-hook that hands the node `grads` instead of what reached it."""
    return lambda _: grads


def _graph(root: Node) -> tuple[dict[Node, list[Node]], list[Node]]:
    """Each node's children, and the nodes children first (iterative: graphs are deep)."""
    children: dict[Node, list[Node]] = {}
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        kids = [f for f, _ in node.next_functions if f is not None]
        children[node] = kids
        stack.append((node, True))
        stack += [(k, False) for k in kids if k not in children]
    return children, order


def _cut(root: Node, input_node: Node, weights: dict[Node, nn.Parameter]) -> list | None:
    """The boundary nodes, in groups that share weights, each with the weights it reaches
    (None where the output does not depend on the input)."""
    children, order = _graph(root)
    to_input: dict[Node, bool] = {}
    to_weight: dict[Node, bool] = {}
    for n in order:  # children before parents
        to_input[n] = n is input_node or any(to_input[k] for k in children[n])
        to_weight[n] = n in weights or any(to_weight[k] for k in children[n])
    if not to_input[root]:
        return None

    def weight_side(n: Node) -> bool:
        return to_weight[n] and not to_input[n]

    reached: dict[Node, set[Node]] = {}  # boundary node -> the weights' nodes it reaches
    for n in order:
        if to_input[n] and any(weight_side(k) for k in children[n]):
            found, stack = set(), [k for k in children[n] if weight_side(k)]
            while stack:
                w = stack.pop()
                if w in weights:
                    found.add(w)
                stack += [k for k in children[w] if weight_side(k)]
            reached[n] = found
    # Union of boundary nodes that reach a common weight.
    owner: dict[Node, int] = {}
    groups: list[tuple[list[Node], set[Node]]] = []
    for n, found in reached.items():
        joined = {owner[w] for w in found if w in owner}
        nodes, ws = [n], set(found)
        for g in sorted(joined):
            nodes += groups[g][0]
            ws |= groups[g][1]
            groups[g] = ([], set())
        groups.append((nodes, ws))
        for w in ws:
            owner[w] = len(groups) - 1
    return [(nodes, [weights[w] for w in ws]) for nodes, ws in groups if nodes]


def input_gradient(x: torch.Tensor | None) -> torch.Tensor | None:
    """What a stage sends back for its input `x` after its backward (None: the first stage's
    batch): zeros where its output did not depend on it."""
    if x is None:
        return None
    return torch.zeros_like(x) if x.grad is None else x.grad


def split_backward(
    out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None, params: list
) -> tuple[torch.Tensor | None, DeferredWeights]:
    """B: the gradient of `x` from `out` (and `grad`, its gradient; None for a loss), with the
    weights' gradient deferred. Where there is no input gradient to hurry (`x` None or not
    differentiable, the first stage), the whole backward runs now and nothing is deferred."""
    if not out.requires_grad:  # (nothing before it trains: a frozen first stage)
        return input_gradient(x), NOTHING_DEFERRED
    weights = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
    groups = None
    if x is not None and x.requires_grad and out.grad_fn is not None:
        groups = _cut(out.grad_fn, get_gradient_edge(x).node, weights)
    if groups is None:
        torch.autograd.backward(out, grad)
        return input_gradient(x), NOTHING_DEFERRED
    kept: dict[Node, tuple] = {}
    hooks = [
        n.register_prehook(lambda g, n=n: kept.__setitem__(n, g)) for ns, _ in groups for n in ns
    ]
    try:
        (input_grad,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    return input_grad, DeferredWeights(groups, kept)
