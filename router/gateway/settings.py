"""The ``gateway:`` section of the router config: where ``dspark-router serve`` listens and what it lets in.

Only pydantic here: :mod:`router.config` imports this module, and loading or checking a config must not import a
web framework. Every limit has a default that is safe on loopback; API keys are off until some are given.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, SecretStr

API_KEYS_ENV = "DSPARK_ROUTER_API_KEYS"


class ApiKey(BaseModel):
    """One bearer token. ``name`` is what logs and metrics may show; the key itself is a secret and never shown."""

    model_config = ConfigDict(extra="forbid")

    key: SecretStr = Field(min_length=1)
    name: str | None = None
    requests_per_minute: int | None = Field(
        default=None, ge=1, description="sustained rate; a burst of up to this many is allowed after a quiet minute"
    )

    @property
    def label(self) -> str:
        return self.name or "unnamed"

    @property
    def principal(self) -> str:
        """Who presents this key, for what is kept per caller (a pool's traffic caches): a digest of the key itself,
        unique to it whatever it is named, and telling nothing of it."""
        return "key:" + hashlib.sha256(self.key.get_secret_value().encode()).hexdigest()[:32]


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_keys: list[ApiKey] = Field(default_factory=list)
    api_keys_env: str | None = Field(
        default=API_KEYS_ENV,
        description="an environment variable with more keys, comma-separated (keys stay out of config files)",
    )
    env_keys_requests_per_minute: int | None = Field(default=None, ge=1, description="the rate of the keys from env")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="larger bodies get a 413 before being read")
    max_concurrency: int = Field(default=64, ge=1, description="completions handed to the router at once")
    max_waiting: int = Field(
        default=256, ge=0, description="completions waiting for one of those slots; more get a 429 with Retry-After"
    )
    retry_after_s: int = Field(default=1, ge=1, description="the Retry-After of a 429 for full queues, and of a 503")
    workers_ready_timeout_s: float = Field(
        default=600.0, gt=0, description="`serve` exits with an error when the models are not loaded by then"
    )

    def keys(self, environ: Mapping[str, str] = os.environ) -> list[ApiKey]:
        """The configured keys and those in ``api_keys_env``; an empty list means no key is required."""
        raw = environ.get(self.api_keys_env, "") if self.api_keys_env else ""
        tokens = [token.strip() for token in raw.split(",") if token.strip()]
        rate = self.env_keys_requests_per_minute
        from_env = [
            ApiKey(key=token, name=f"{self.api_keys_env}[{i}]", requests_per_minute=rate)
            for i, token in enumerate(tokens)
        ]
        return [*self.api_keys, *from_env]
