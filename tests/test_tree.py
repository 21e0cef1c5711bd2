"""Token trees: looked-up blocks merged into one tree, cut best first to any size with every node's parent kept, and
verified exactly (greedy: plain decoding's tokens; sampled: each token distributed as the target's p)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from backends.default_model import DEFAULT_MODEL
from backends.dspark.backend import DSparkBackend
from backends.dspark.tree import ANCHOR, Branch, TokenTree, merged, verify_tree
from backends.loading import load_model
from backends.sampling import sample, token_probs
from backends.scheduling import prefix_survival
from backends.types import DSparkOptions, GenerationRequest

BLOCKS = [Branch([1, 2, 3], [0.9, 0.5, 0.5]), Branch([1, 4], [0.8, 0.9]), Branch([5, 6], [0.3, 0.9])]


def _branches(tree: TokenTree) -> list[list[int]]:
    """Each leaf's tokens from the anchor, in the tree's order."""
    leaves = [node for node in range(len(tree)) if node not in tree.parents]
    return [[tree.tokens[n] for n in tree.path(leaf)] for leaf in leaves]


def test_blocks_merge_into_a_trie_with_the_likeliest_branch_first():
    tree = merged(BLOCKS)
    assert _branches(tree) == [[1, 4], [1, 2, 3], [5, 6]]  # 1, 4 (0.72) is likelier than 1, 2 (0.45)
    assert tree.parents[:3] == [ANCHOR, 0, 0]  # the first branch is a chain: it stands at its positions
    first_level = [tree.chance[n] for n, parent in enumerate(tree.parents) if parent == ANCHOR]
    assert sum(first_level) == pytest.approx(1.0)  # 0.9 and 0.3 cannot both be right: scaled to share 1
    assert all(tree.chance[n] <= tree.chance[p] for n, p in enumerate(tree.parents) if p != ANCHOR)
    assert tree.reach([1, 2, 7]) == 2 and tree.reach([5, 6]) == 2 and tree.reach([8]) == 0


@pytest.mark.parametrize("count", range(len(merged(BLOCKS)) + 1))
def test_any_best_first_cut_keeps_every_nodes_parent_and_its_survival_is_their_chances(count):
    """What the engine's schedule reads (:meth:`TokenTree.best_first`) is a block's conditional acceptance whose
    prefix survival is the nodes' chances, best first; the cut it chooses is a tree laid out depth first."""
    tree = merged(BLOCKS)
    cut = tree.first(count)
    best = sorted(tree.chance, reverse=True)
    assert prefix_survival(tree.best_first()) == pytest.approx(best)
    assert sorted(cut.chance, reverse=True) == pytest.approx(best[:count])
    assert all(parent < node for node, parent in enumerate(cut.parents))
    first_branch = cut.reach(_branches(cut)[0]) if count else 0
    assert all(parent == node - 1 for node, parent in enumerate(cut.parents[:first_branch]))


def test_a_cut_is_a_tree_even_where_rounding_ranks_a_child_above_its_parent():
    """Scaling siblings to share their parent's chance can leave a child one rounding step above it; the cut still
    starts at the anchor's child (an empty cut made the round read no target at the anchor: greedy_targets' bug)."""
    tree = TokenTree([1, 2], [ANCHOR, 0], [0.3, 0.3 + 1e-16], [False, False])
    assert tree.first(1).tokens == [1] and tree.first(2).tokens == [1, 2]
    shared = merged([Branch([1, 2], [0.7, 1.0]), Branch([3], [0.7])])
    assert all(shared.chance[n] <= shared.chance[p] for n, p in enumerate(shared.parents) if p != ANCHOR)


def test_greedy_keeps_the_branch_the_targets_argmax_follows_and_ends_with_its_next_token():
    tree = merged([Branch([1, 2, 3], [0.9, 0.9, 0.9]), Branch([1, 4, 5], [0.5, 0.5, 0.5])])
    assert tree.tokens == [1, 2, 3, 4, 5] and tree.parents == [ANCHOR, 0, 1, 0, 3]
    logits = torch.zeros(1 + len(tree), 10)
    for row, token in {0: 1, 1: 4, 4: 5, 5: 9, 2: 3}.items():  # rows: the anchor, then each node
        logits[row, token] = 1.0
    path, after = verify_tree(tree, logits, None, None)
    assert [tree.tokens[n] for n in path] == [1, 4, 5] and after == 9
    logits[1] = 0.0
    logits[1, 7] = 1.0  # the target writes 1, 7: neither branch past the first token
    assert verify_tree(tree, logits, None, None) == ([0], 7)


def test_sampled_tree_verification_is_distributed_as_the_target_on_a_tiny_model(tiny_model_paths):
    """Two tokens after a prompt, sampled from a tiny Llama's top 3 through a tree of every top-3 branch but one
    (so every rule is reached: a first child kept, a later child kept after the first was rejected, no child kept
    and the token drawn from the residual): their joint distribution is plain sampling's, by a chi-square test.
    Keeping the first child whenever it is the target's argmax, as greedy does, is caught by the same test."""
    loaded = load_model(tiny_model_paths["llama"])
    request = GenerationRequest(prompt="def", temperature=1.0, top_k=3)
    prompt = loaded.tokenizer("def")["input_ids"]

    def probs(prefix: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return token_probs(loaded.model(torch.tensor([[*prompt, *prefix]])).logits[0, -1], request)

    first = probs([]).topk(3).indices.tolist()
    branches = [[first[0], probs(first[:1]).topk(3).indices.tolist()[k]] for k in (0, 2)] + [[first[1]]]
    tree = merged([Branch(tokens, [0.5] * len(tokens)) for tokens in branches])
    rows = torch.stack([probs([]), *(probs([tree.tokens[n] for n in tree.path(node)]) for node in range(len(tree)))])
    exact = {(a, b): float(probs([])[a] * probs([a])[b]) for a in first for b in probs([a]).topk(3).indices.tolist()}

    def two_tokens(generator: torch.Generator, rule) -> tuple[int, int]:
        path, after = rule(generator)
        tokens = [*(tree.tokens[n] for n in path), after]
        if len(tokens) < 2:  # the next round, from the token drawn
            tokens.append(int(sample(probs(tokens), generator)))
        return tokens[0], tokens[1]

    def exact_rule(generator):
        return verify_tree(tree, rows.log(), rows, generator)

    def greedy_first(generator):
        if rows[0].argmax() == tree.tokens[0]:
            return [0], int(sample(rows[1], generator))
        return verify_tree(tree, rows.log(), rows, generator)

    for rule, passes in ((exact_rule, True), (greedy_first, False)):
        generator = torch.Generator().manual_seed(0)
        counts: dict[tuple[int, int], int] = {}
        for _ in range(3000):
            drawn = two_tokens(generator, rule)
            counts[drawn] = counts.get(drawn, 0) + 1
        assert set(counts) <= set(exact)
        expected = [exact[k] * 3000 / sum(exact.values()) for k in exact]
        p_value = chisquare([counts.get(k, 0) for k in exact], expected).pvalue
        assert (p_value > 1e-3) == passes, p_value


def test_sampled_requests_verify_trees_of_the_copies_that_went_different_ways():
    """A sampled request's looked-up blocks are copies from its own context: where an n-gram went on two ways (a
    list that repeats with a change), both copies are one tree, verified by the rule above, on the default model;
    with trees left off (the default) none is."""
    backend = DSparkBackend.from_pretrained(DEFAULT_MODEL, drafter="dspark")
    text = "List the colours: red, green, blue, red, green, yellow, red, green, blue, red, green, yellow. Repeat it."
    rounds = {}
    for trees in (True, None):
        rounds[trees] = sum(
            backend.complete(
                GenerationRequest(
                    messages=[{"role": "user", "content": text}],
                    max_tokens=48,
                    temperature=0.7,
                    seed=seed,
                    dspark=DSparkOptions(trees=trees),
                )
            ).stats.spans.tree_rounds
            for seed in range(3)
        )
    assert rounds[True] > 0 and rounds[None] == 0
