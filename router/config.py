"""The router's YAML config: pools, routing policy, decision log; validated up front, every error names its key.

Everything a request can hit at run time (a rule's pool, an overflow or fallback target, a tenant's default) is
checked against the declared pools at load, so a typo fails the start-up, not the thousandth request.
Strings may use ``${VAR}`` or ``${VAR:-default}`` to take values (API keys, the demo model path) from the
environment. Relative model and classifier paths are relative to the config file (for the embedded default:
the repository); ``model: default`` is the default model and ``drafter_path: default`` its drafters.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from backends.default_model import DEFAULT_MODEL, DEFAULT_NAME, REPO_ROOT, drafters_for
from backends.traffic_settings import TrafficSettings
from backends.types import DSparkOptions
from router.errors import ConfigError
from router.gateway.settings import GatewayConfig

DEFAULT_CONFIG = Path(__file__).with_name("default.yaml")

MODEL_ENV = "DSPARK_ROUTER_MODEL"
RESERVED_RULE_NAMES = frozenset({"hint", "classifier", "time_saved", "default"})
POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingDefaults(_Strict):
    """Values for arguments a client leaves out, in place of OpenAI's (temperature 1, top_p 1; max_tokens 256).

    On the policy they are filled in before routing, so rules, the classifier and the decision log see them as
    if the client had sent them. On a pool they are that pool's own decoding choice (a greedy DSpark pool, say),
    filled in when the request is admitted there: the pool is not known before routing, so rules and the
    classifier see the policy's value, and the decision record shows the one the pool decoded with.
    """

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)

    def values(self) -> dict[str, float | int]:
        return {name: value for name, value in self if value is not None}


class RedisTransport(_Strict):
    """How a pool's jobs travel to workers on other hosts (``transport: redis``); see ``router/redis_pool.py``."""

    prefix: str = Field(
        default="dspark-router", pattern=r"^[A-Za-z0-9_.:-]+$", description="key prefix: deployments sharing a Redis"
    )

    visibility_timeout_s: float = Field(
        default=30.0, gt=0, description="a job whose worker sent no heartbeat for this long is run by another"
    )
    max_deliveries: int = Field(default=3, ge=1, description="deliveries before a job goes to the dead-letter stream")
    heartbeat_s: float = Field(default=2.0, gt=0, description="how often workers report liveness and load")
    reply_ttl_s: float = Field(default=600.0, gt=0, description="how long a request's reply stream outlives it")
    connect_timeout_s: float = Field(
        default=1.0, gt=0, description="the longest an unreachable Redis may hold up a request before it gets a 503"
    )

    @model_validator(mode="after")
    def _heartbeats_fit(self) -> RedisTransport:
        if self.heartbeat_s * 3 > self.visibility_timeout_s:
            raise ValueError("visibility_timeout_s must be at least 3 heartbeats, or live workers lose their jobs")
        return self


class HealthConfig(_Strict):
    """When a pool counts as down (LiteLLM's router semantics; see ``router/health.py``)."""

    allowed_fails: int = Field(default=3, ge=1, description="failures in a row before the pool is cooled down")
    cooldown_s: float = Field(default=30.0, gt=0, description="how long a cooled-down pool takes no requests")
    check_interval_s: float | None = Field(
        default=10.0, gt=0, description="health checks of remote engines and Redis pools; null: none"
    )


class PoolLoadConfig(_Strict):
    """What ``policy.objective: time_saved`` assumes about a pool's speed under load (see ``router/expected_time.py``).

    With a profile, a request's decode rate at a batch of b comes from the target's steps per second by forward
    length; without one (remote engines), from ``tokens_per_s`` slowed by the pool's depth."""

    profile: str | None = Field(
        default="auto",
        description="the steps-per-second curve: 'auto' (the model folder's dspark_sps.json, when it has one), "
        "a dspark_sps.json path, or null for none",
    )
    verify_tokens: float | None = Field(
        default=None,
        ge=1.0,
        description="DSpark pools: tokens a request feeds each forward (anchor plus verified draft, k + 1); "
        "null: measured on the pool's own passes of one request (4 until the first)",
    )
    speedup_floor: float = Field(
        default=0.0, ge=0.0, description="DSpark pools: the least speedup assumed under load, however full"
    )
    tokens_per_s: float | None = Field(
        default=None, gt=0, description="a request's decode rate alone, for a pool without a profile"
    )
    row_s: float = Field(
        default=0.0,
        ge=0.0,
        description="seconds each request beyond the first adds to a forward, outside the profile's curve of one "
        "request (sampling, bookkeeping, padding; bench batching measures it)",
    )


class PoolConfig(_Strict):
    """One pool of workers over one backend. For local backends each worker is a replica of the model that
    decodes up to ``max_batch`` requests at once; for litellm pools ``max_batch`` requests are in flight per
    worker, and the engine behind it batches them."""

    backend: Literal["dspark", "autoregressive", "litellm"]
    model: str = Field(min_length=1, description="model folder, or the litellm model name for litellm pools")
    api_base: str | None = None
    api_key: str | None = None
    workers: int = Field(default=1, ge=1, le=64)
    max_batch: int = Field(
        default=16, ge=1, le=1024, description="requests one worker decodes at once, in one batch (local backends)"
    )
    max_kv_tokens: int = Field(
        default=65_536,
        ge=1,
        description="KV cache positions a worker's running requests may hold, counted as prompt + max_tokens each",
    )
    max_queue: int = Field(default=32, ge=0, le=100_000, description="requests waiting beyond the running ones")
    prefix_cache_mb: float = Field(
        default=64.0,
        ge=0,
        le=65_536,
        description="memory per worker for prompts kept so a request sharing their start (an agent's template) "
        "copies it instead of prefilling it; per tenant, like the traffic cache (0: off; the packed engine's)",
    )
    device: str = Field(default="auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")
    dtype: Literal["auto", "gguf", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="auto: the packed engine on a GGUF-converted folder (gguf), else bfloat16 or float32 by the CPU",
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="the packed engine's threads for this pool's model (null: the physical cores this process may "
        "use); pools on one model with the same threads share one copy of it and one set of threads",
    )
    timeout_s: float = Field(default=120.0, gt=0)
    max_tokens: int | None = Field(
        default=None, ge=1, description="the most tokens one request may ask of this pool; more is refused (400)"
    )
    defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)
    decoding: DSparkOptions | None = None
    drafter: Literal["heads", "dspark"] | None = Field(
        default=None,
        description="dspark pools: span heads, or the published drafter (the model folder's dspark_drafter/); "
        "null: the project's default drafter where the folder carries it, else the one it carries",
    )
    drafter_path: str | None = Field(
        default=None,
        min_length=1,
        description="dspark pools: the folder the drafters come from, when not the model's own: span heads and a "
        "dspark_drafter/ folder, or a published DSpark drafter folder itself (deepseek-ai/dspark_qwen3_8b_block7)",
    )
    traffic: TrafficSettings | None = Field(
        default=None,
        description="dspark pools: drafting from the pool's earlier answers (null: on, with the defaults); "
        "a request's dspark.traffic may override the drafting options",
    )
    transport: Literal["inprocess", "redis"] = Field(
        default="inprocess", description="inprocess: workers are threads here; redis: `dspark-router worker` processes"
    )
    redis_url: str | None = Field(default=None, description="for transport redis; else the top-level redis_url")
    redis: RedisTransport = Field(default_factory=RedisTransport)
    health: HealthConfig = Field(default_factory=HealthConfig)
    load: PoolLoadConfig = Field(default_factory=PoolLoadConfig)

    @field_validator("api_base", "api_key")
    @classmethod
    def _litellm_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("backend", "litellm") != "litellm":
            raise ValueError(f"{info.field_name} applies to litellm pools only")
        return value

    @field_validator("decoding", "drafter_path", "traffic")
    @classmethod
    def _dspark_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("backend", "dspark") != "dspark":
            raise ValueError(f"{info.field_name} applies to dspark pools only")
        return value

    @field_validator("decoding")
    @classmethod
    def _one_drafter_key(cls, value: DSparkOptions | None) -> DSparkOptions | None:
        """``drafter`` chooses a pool's drafter; ``decoding`` holds the options a request may override, and a
        drafter there would be a second key for the same choice."""
        if value is not None and value.drafter is not None:
            raise ValueError("a pool's drafter is chosen by its drafter key, not decoding.drafter")
        return value

    @property
    def local(self) -> bool:
        """Whether the pool's model is a folder (loaded here or, with transport redis, by its workers)."""
        return self.backend != "litellm"

    @property
    def loads_here(self) -> bool:
        """Whether this process loads the model: a router in front of Redis workers needs no model on disk."""
        return self.local and self.transport == "inprocess"


class TemperatureRange(_Strict):
    """Inclusive bounds."""

    min: float = Field(default=0.0, ge=0.0, le=2.0)
    max: float = Field(default=2.0, ge=0.0, le=2.0)

    @model_validator(mode="after")
    def _ordered(self) -> TemperatureRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class RuleMatch(_Strict):
    """Conditions of one rule; all that are given must hold."""

    response_format: list[str] | None = Field(default=None, description="response_format types; 'text' if none")
    tools: bool | None = Field(default=None, description="whether the request carries tools")
    temperature: TemperatureRange | None = None
    prompt_regex: re.Pattern[str] | None = Field(default=None, description="searched in the last user message")
    tags: list[str] | None = Field(default=None, description="all of these must be in metadata['tags']")

    @model_validator(mode="after")
    def _not_empty(self) -> RuleMatch:
        if all(getattr(self, name) is None for name in type(self).model_fields):
            raise ValueError("a rule needs at least one condition")
        return self


class Rule(_Strict):
    name: str = Field(min_length=1)
    pool: str
    match: RuleMatch

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value in RESERVED_RULE_NAMES:
            raise ValueError(f"{value!r} is reserved for the policy's own decisions")
        return value


class TenantOverride(_Strict):
    """What one tenant changes; its rules run before the global ones."""

    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    explore: float | None = Field(default=None, ge=0.0, le=0.5)
    default_pool: str | None = None
    rules: list[Rule] = Field(default_factory=list)


class PolicyConfig(_Strict):
    """Where requests go: hint, then rules in order, then the classifier, then ``default_pool``.

    ``objective`` is how the classifier decides: ``threshold`` routes to DSpark when its score reaches the
    threshold, whatever the load; ``time_saved`` routes to the pool where the request's expected time is
    shorter, from the expected-gain model's speedup and each pool's load right now (see
    ``router/expected_time.py``)."""

    classifier: str | None = "default"
    objective: Literal["threshold", "time_saved"] = "threshold"
    threshold: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="route to dspark_pool when the score reaches it; None: the classifier's own (its `threshold`, "
        "chosen at calibration to save the most time), or 0.5 for a scorer without one",
    )
    dspark_pool: str = "dspark"
    standard_pool: str = "standard"
    default_pool: str | None = None
    hints: bool = True
    rules: list[Rule] = Field(default_factory=list)
    overflow: dict[str, str] = Field(default_factory=dict, description="pool -> pool to spill to when full")
    fallback: dict[str, str] = Field(default_factory=dict, description="pool -> pool to retry on error/timeout")
    explore: float = Field(default=0.0, ge=0.0, le=0.5)
    shadow: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="share of dspark/standard requests replayed on the other pool once answered, to log a speedup",
    )
    learn_templates: bool = Field(
        default=True,
        description="objective time_saved: weigh each template's measured DSpark speedup (per tenant: its system "
        "prompt, schema and tools) against the classifier's, and send a repeated template DSpark never answered "
        "there to be measured (router/templates.py)",
    )
    seed: int = 0
    defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)
    tenants: dict[str, TenantOverride] = Field(default_factory=dict)


class LogConfig(_Strict):
    """Where completed requests are recorded, for ``calibrate --from-log``."""

    jsonl: str | None = None
    redis_stream: str | None = None
    redis_maxlen: int = Field(default=100_000, ge=1)
    include_request: bool = True


class RouterConfig(_Strict):
    pools: dict[str, PoolConfig] = Field(min_length=1)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    redis_url: str | None = None
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, pools: dict[str, PoolConfig]) -> dict[str, PoolConfig]:
        for name in pools:
            if name == "auto" or not POOL_NAME.match(name):
                raise ValueError(f"pool name {name!r} must be a word of letters, digits, '_', '-', '.', not 'auto'")
        return pools


def load_config(path: str | Path | None = None, *, check_paths: bool = True) -> RouterConfig:
    """A YAML file, or with no path the embedded default (two local pools on the demo model).

    ``check_paths`` also requires local model folders to exist, so a wrong path fails here and not at the first
    request; turn it off to inspect a config whose models are not there (yet).
    """
    file = Path(path) if path is not None else DEFAULT_CONFIG
    base_dir = file.resolve().parent if path is not None else REPO_ROOT
    source = str(file)
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise ConfigError("", f"cannot read the config: {exc.strerror or exc}", source=source) from exc
    except yaml.YAMLError as exc:
        raise ConfigError("", f"not valid YAML: {exc}", source=source) from exc
    config = parse_config(data, base_dir=base_dir, source=source)
    if check_paths:
        hint = (
            "" if path is not None else f" (convert the default model with `dspark-router convert`, or set {MODEL_ENV})"
        )
        for name, pool in config.pools.items():
            if pool.loads_here and not Path(pool.model).is_dir():
                raise ConfigError(f"pools.{name}.model", f"{pool.model!r} is not a model folder{hint}", source=source)
            if pool.loads_here and pool.drafter_path is not None and not Path(pool.drafter_path).is_dir():
                raise ConfigError(f"pools.{name}.drafter_path", f"{pool.drafter_path!r} is not a folder", source=source)
    return config


def parse_config(data: Any, *, base_dir: Path, source: str | None = None) -> RouterConfig:
    """Validate already-parsed YAML/JSON data; relative local paths resolve against ``base_dir``."""
    if not isinstance(data, dict):
        raise ConfigError("", "the config must be a mapping with at least 'pools'", source=source)
    data = _expand_env(data, "", source)
    try:
        config = RouterConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        raise ConfigError(key, first["msg"].removeprefix("Value error, "), source=source) from None
    _check_references(config, source)
    return _resolve_paths(config, base_dir)


def _expand_env(value: Any, key: str, source: str | None) -> Any:
    if isinstance(value, dict):
        return {k: _expand_env(v, f"{key}.{k}" if key else str(k), source) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{key}.{i}", source) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(
                key, f"environment variable {name} is not set (write ${{{name}:-default}})", source=source
            )
        return default

    return ENV_REFERENCE.sub(substitute, value)


def _check_references(config: RouterConfig, source: str | None) -> None:
    pools = set(config.pools)
    policy = config.policy

    def check(key: str, name: str | None) -> None:
        if name is not None and name not in pools:
            raise ConfigError(key, f"unknown pool {name!r} (pools: {', '.join(sorted(pools))})", source=source)

    exploring = policy.explore > 0 or policy.shadow > 0 or any(t.explore for t in policy.tenants.values())
    if policy.objective == "time_saved" and policy.classifier is None:
        raise ConfigError(
            "policy.objective",
            "time_saved routes by the classifier's expected gain: set policy.classifier",
            source=source,
        )
    if policy.classifier is not None or exploring:
        check("policy.dspark_pool", policy.dspark_pool)
        check("policy.standard_pool", policy.standard_pool)
    check("policy.default_pool", policy.default_pool)
    for kind in ("overflow", "fallback"):
        for origin, target in getattr(policy, kind).items():
            check(f"policy.{kind}.{origin}", origin)
            check(f"policy.{kind}.{origin}", target)
            if origin == target:
                raise ConfigError(
                    f"policy.{kind}.{origin}", "a pool cannot spill or fall back to itself", source=source
                )
    for prefix, rules in [("policy.rules", policy.rules)] + [
        (f"policy.tenants.{tenant}.rules", override.rules) for tenant, override in policy.tenants.items()
    ]:
        names: set[str] = set()
        for i, rule in enumerate(rules):
            check(f"{prefix}.{i}.pool", rule.pool)
            if rule.name in names:
                raise ConfigError(f"{prefix}.{i}.name", f"rule name {rule.name!r} is used twice", source=source)
            names.add(rule.name)
    for tenant, override in policy.tenants.items():
        check(f"policy.tenants.{tenant}.default_pool", override.default_pool)
    default_tokens = policy.defaults.max_tokens
    for name, pool in config.pools.items():
        if default_tokens is not None and pool.max_tokens is not None and default_tokens > pool.max_tokens:
            raise ConfigError(
                "policy.defaults.max_tokens",
                f"{default_tokens} is above pool {name!r}'s max_tokens cap of {pool.max_tokens}",
                source=source,
            )
    for name, pool in config.pools.items():
        if pool.transport == "redis" and not (pool.redis_url or config.redis_url):
            raise ConfigError(
                f"pools.{name}.transport", "redis needs redis_url, on the pool or at the top level", source=source
            )
    if config.log.redis_stream and not config.redis_url:
        raise ConfigError("log.redis_stream", "needs redis_url at the top level", source=source)


def _resolve_paths(config: RouterConfig, base_dir: Path) -> RouterConfig:
    def resolved(pool: PoolConfig) -> PoolConfig:
        """``default`` names the default model (:mod:`backends.default_model`), and as ``drafter_path`` its
        drafters where the model is the default one (another model carries its own, or none)."""
        model = DEFAULT_MODEL if pool.model == DEFAULT_NAME else base_dir / Path(pool.model).expanduser()
        drafters = pool.drafter_path
        if drafters == DEFAULT_NAME:
            drafters = str(drafters_for(model)) if model == DEFAULT_MODEL else None
        elif drafters is not None:
            drafters = str(base_dir / Path(drafters).expanduser())
        return pool.model_copy(update={"model": str(model), "drafter_path": drafters})

    pools = {name: resolved(pool) if pool.local else pool for name, pool in config.pools.items()}
    pools = {name: _resolve_profile(pool, base_dir) for name, pool in pools.items()}
    pools = {
        name: pool.model_copy(update={"redis_url": pool.redis_url or config.redis_url})
        if pool.transport == "redis"
        else pool
        for name, pool in pools.items()
    }
    policy = config.policy
    if policy.classifier not in (None, "default"):
        policy = policy.model_copy(update={"classifier": str(base_dir / Path(policy.classifier).expanduser())})
    log = config.log
    if log.jsonl is not None:
        log = log.model_copy(update={"jsonl": str(base_dir / Path(log.jsonl).expanduser())})
    return config.model_copy(update={"pools": pools, "policy": policy, "log": log})


def _resolve_profile(pool: PoolConfig, base_dir: Path) -> PoolConfig:
    """A profile file named relative to the config, made absolute; ``auto`` and null stay as they are."""
    if pool.load.profile in (None, "auto"):
        return pool
    profile = str(base_dir / Path(pool.load.profile).expanduser())
    return pool.model_copy(update={"load": pool.load.model_copy(update={"profile": profile})})
