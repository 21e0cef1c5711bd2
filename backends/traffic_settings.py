"""A pool's traffic cache settings and a request's options for it (:mod:`backends.dspark.traffic`), torch-free:
the router's config and a request's validation read them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MIN_MATCH = 3
"""The shortest match the cache drafts from: the n-gram it indexes (a request's own context, which the n-gram
lookup covers from a single token, handles shorter ones)."""


class TrafficOptions(BaseModel):
    """How a request drafts from its pool's earlier answers (:mod:`backends.dspark.traffic`); a pool's
    ``traffic`` sets them for its requests, and a request's ``dspark.traffic`` may override them."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="draft from earlier answers at all")
    depth: int = Field(default=32, ge=MIN_MATCH, le=256, description="the longest suffix a match is measured over")
    min_token_prob: float = Field(
        default=0.1, ge=0.0, le=1.0, description="a draft stops where its path's probability falls below this"
    )
    length_factor: float = Field(
        default=1.0, gt=0.0, le=8.0, description="a match of m tokens drafts at most floor(m * length_factor)"
    )


class TrafficSettings(TrafficOptions):
    """A pool's traffic cache: the request-level options' defaults, and what only the pool decides."""

    max_tokens: int = Field(
        default=1_000_000,
        ge=1_000,
        description="tokens cached in all the pool's scopes together before the oldest answers are evicted",
    )
    shared: bool = Field(
        default=False,
        description="one cache for every tenant of the pool; off: one per tenant (the README's isolation rule)",
    )
    datastore: bool = Field(
        default=True,
        description="draft from the target's own answers shipped with its drafters as well (read-only, every tenant's)",
    )
