"""Token trees: several looked-up blocks merged into one tree and verified by one forward.

A round may have more than one block to look up (a copy from the context, a draft from the pool's earlier answers
and, where those answers split, its runner-up paths, one from the target's shipped answers); where they disagree,
verifying one of them throws the others away. Merged into a trie after the anchor, every branch is verified by the
same forward (the packed engine's tree attention: each token sees only its ancestors), and the round commits the
longest branch the target accepts. A round verifies a tree only where it is expected to beat its best block alone
(``published_decode.tree_pays``), and pools leave trees off unless asked: on 2 CPU cores they committed 1-4% more
tokens a forward on an agent trace and ran 1-3% slower (README, "Token trees").

* **What each node is worth.** A branch's tokens carry their conditional acceptance (what blocks of their kind
  earned, :mod:`backends.dspark.lookup`); a node's chance to be on the accepted path is the product along its branch
  (the best of the branches through it), and siblings, which cannot both be right, share at most their parent's.
* **How many nodes.** Nodes are ranked best first; any leading run of that order holds every node's parent, and its
  chances fall, so they are the prefix survival Algorithm 1 weighs for a block (:mod:`backends.scheduling`): the
  engine chooses how many to verify exactly as it chooses a block's length, from the cost curve and the batch.
* **Layout.** The kept nodes go depth first, each node's likeliest child first, so the tree's first branch is
  written at its positions as any draft is, and only the tokens off it take slots past it.
* **Verification.** Greedy follows, from the anchor, the child equal to the target's argmax, and ends with the
  target's argmax after the last one kept (exactly plain decoding's tokens). Sampling tries a node's children in
  order, each accepted with probability r(x) / sum(r) of a residual r that starts as the target's p and loses each
  rejected child's token; where none is accepted the next token is drawn from r. Each branch is one proposal drawn
  with certainty, so each committed token is distributed exactly as p (SpecInfer's multi-draft rule for
  deterministic drafts: the first child is kept with p(x1), the second with (1 - p(x1)) p(x2) / (1 - p(x1)), ...).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from backends.constraints import GrammarConstraint
from backends.sampling import greedy_tokens, sample

ANCHOR = -1
"""The parent of the tree's first tokens: the round's anchor, committed already."""


@dataclass(frozen=True)
class Branch:
    """A block a tree merges: its tokens after the anchor and their conditional acceptance."""

    tokens: list[int]
    confidence: list[float]
    forced: list[bool] | None = None
    """Per token, under a grammar: text the grammar forces there."""


@dataclass(frozen=True)
class TokenTree:
    """Nodes depth first, each node's likeliest child first (the first branch at its positions)."""

    tokens: list[int]
    parents: list[int]
    """Each node's parent, an index into ``tokens`` (:data:`ANCHOR` for the anchor)."""
    chance: list[float]
    """Each node's estimated chance to be on the accepted path."""
    forced: list[bool]
    """Nodes the grammar forces after their parent: kept unchecked, as plain decoding commits forced text."""

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[int, list[int]]:
        """Each node's children in order (likeliest first), the anchor's under :data:`ANCHOR`."""
        found: dict[int, list[int]] = {ANCHOR: []}
        for node, parent in enumerate(self.parents):
            found.setdefault(parent, []).append(node)
            found.setdefault(node, [])
        return found

    def path(self, node: int) -> list[int]:
        """The nodes from the anchor's child to ``node``."""
        path = []
        while node != ANCHOR:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @property
    def depth(self) -> int:
        """Tokens on the tree's longest branch."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent == ANCHOR else depths[parent] + 1)
        return max(depths, default=0)

    def reach(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` are a branch of the tree (of a block, how many of its tokens it verifies)."""
        children, at = self.children(), ANCHOR
        for reached, token in enumerate(tokens):
            at = next((child for child in children[at] if self.tokens[child] == token), None)
            if at is None:
                return reached
        return len(tokens)

    def ranked(self) -> list[int]:
        """Every node best first, each after its parent: the likeliest node whose parent is already ranked next,
        ties to the earlier node. Chances fall from parent to child (:func:`_shared`), so this is the nodes by
        falling chance, and any leading run of it is a tree."""
        children = self.children()
        frontier = [(-self.chance[node], node) for node in children[ANCHOR]]
        heapq.heapify(frontier)
        order: list[int] = []
        while frontier:
            _, node = heapq.heappop(frontier)
            order.append(node)
            for child in children[node]:
                heapq.heappush(frontier, (-self.chance[child], child))
        return order

    def best_first(self) -> list[float]:
        """The schedule's view of the tree: the conditional acceptance of its nodes ranked best first (each node's
        chance over the one before), whose prefix survival is the nodes' chances (:meth:`ranked`)."""
        chances = [self.chance[node] for node in self.ranked()]
        return [c / before if before > 0 else 0.0 for before, c in zip([1.0, *chances], chances)]

    def first(self, count: int) -> TokenTree:
        """The ``count`` best nodes (:meth:`ranked`), laid out again depth first."""
        return layout(self, set(self.ranked()[:count]))


def merged(branches: list[Branch]) -> TokenTree:
    """The trie of ``branches`` after the anchor, with each node's chance (see the module's rules)."""
    tokens: list[int] = []
    parents: list[int] = []
    chance: list[float] = []
    forced: list[bool] = []
    index: dict[tuple[int, int], int] = {}
    for branch in branches:
        parent, survival = ANCHOR, 1.0
        for k, (token, confidence) in enumerate(zip(branch.tokens, branch.confidence)):
            survival *= confidence
            node = index.get((parent, token))
            if node is None:
                node = index[parent, token] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                chance.append(survival)
                forced.append(branch.forced is not None and branch.forced[k])
            else:
                chance[node] = max(chance[node], survival)
            parent = node
    tree = TokenTree(tokens, parents, _shared(tokens, parents, chance), forced)
    return layout(tree, set(range(len(tree))))


def _shared(tokens: list[int], parents: list[int], chance: list[float]) -> list[float]:
    """Chances where siblings together take no more than their parent's (the anchor's being 1): they are exclusive."""
    kept = list(chance)
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    for parent in [ANCHOR, *range(len(tokens))]:  # a parent is settled before its children
        siblings = children.get(parent, [])
        ceiling = 1.0 if parent == ANCHOR else kept[parent]
        total = sum(kept[node] for node in siblings)
        for node in siblings:  # no child above its parent, rounding included
            kept[node] = min(kept[node] * ceiling / total if total > ceiling else kept[node], ceiling)
    return kept


def layout(tree: TokenTree, keep: set[int]) -> TokenTree:
    """The nodes in ``keep`` depth first, each node's children by falling chance."""
    children = tree.children()
    order: list[int] = []
    parents: list[int] = []

    def visit(node: int, parent: int) -> None:
        at = len(order)
        order.append(node)
        parents.append(parent)
        for child in _likeliest_first(tree, children[node], keep):
            visit(child, at)

    for child in _likeliest_first(tree, children[ANCHOR], keep):
        visit(child, ANCHOR)
    return TokenTree(
        [tree.tokens[n] for n in order], parents, [tree.chance[n] for n in order], [tree.forced[n] for n in order]
    )


def _likeliest_first(tree: TokenTree, nodes: list[int], keep: set[int]) -> list[int]:
    return sorted((node for node in nodes if node in keep), key=lambda node: (-tree.chance[node], node))


def greedy_targets(tree: TokenTree, logits: torch.Tensor, constraint: GrammarConstraint) -> list[int]:
    """The target's argmax at the anchor and at each node (``logits`` [1 + nodes, V]) under ``constraint``, from the
    grammar's state after the node's own branch: each leaf's branch is one draft to the grammar."""
    targets = constraint.greedy(logits[:1], [])  # the anchor's row, read by every leaf's branch too
    targets += [0] * len(tree)
    children = tree.children()
    for leaf in (node for node in range(len(tree)) if not children[node]):
        path = tree.path(leaf)
        rows = [0, *(node + 1 for node in path)]
        found = constraint.greedy(logits[rows], [tree.tokens[n] for n in path], [tree.forced[n] for n in path])
        for row, target in zip(rows, found):
            targets[row] = target
    return targets


def verify_tree(
    tree: TokenTree,
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    generator: torch.Generator | None,
    constraint: GrammarConstraint | None = None,
) -> tuple[list[int], int]:
    """The nodes kept (a path from the anchor's child) and the token after them. ``logits`` [1 + nodes, V] are the
    forward's at the anchor and each node; ``probs`` the same rows as the request's sampling distributions (None:
    greedy, under ``constraint``'s grammar where given). A forced node is kept unchecked."""
    children = tree.children()
    path: list[int] = []
    at = ANCHOR
    if probs is None:
        targets = greedy_targets(tree, logits, constraint) if constraint is not None else None
        while True:  # without a grammar, only the rows the walk reaches are read
            want = targets[at + 1] if targets is not None else greedy_tokens(logits[at + 1 : at + 2])[0]
            kept = next((c for c in children[at] if tree.forced[c] or tree.tokens[c] == want), None)
            if kept is None:
                return path, want
            path.append(kept)
            at = kept
    while True:
        residual, copied, kept = probs[at + 1], False, None
        for child in children[at]:
            token, total = tree.tokens[child], float(residual.sum())
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if tree.forced[child] or (total > 0 and u * total < float(residual[token])):
                kept = child
                break
            if not copied:
                residual, copied = residual.clone(), True
            residual[token] = 0.0
        if kept is None:
            return path, int(sample(residual if residual.sum() > 0 else probs[at + 1], generator))
        path.append(kept)
        at = kept
