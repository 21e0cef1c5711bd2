"""DSparkBackend: the DSpark pool's decoder behind the shared Backend protocol, with either drafter.

``heads``: the span heads beside the model (``dspark_config.json``), the seed's multi-granularity spans.
``dspark``: the published drafter (a ``dspark_drafter/`` folder in DeepSpec's layout beside, or inside, the
target's folder), scheduled by Algorithm 1 over the target's steps-per-second profile. A backend loads whichever
drafters its folder carries; the pool picks the default, a request's ``dspark.drafter`` may pick the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from backends.constraints import GrammarConstraint
from backends.default_model import drafters_for
from backends.dspark import published_decode
from backends.dspark.datastore import CORPUS_DIR, Datastore
from backends.dspark.decode import decode
from backends.dspark.drafter import DSparkDrafter, state_layers
from backends.dspark.drafter_config import DRAFTER_DIR, is_drafter_dir
from backends.dspark.heads import CONFIG_FILE as HEADS_CONFIG_FILE
from backends.dspark.heads import SpanHeads
from backends.dspark.lookup import CopyAcceptance
from backends.dspark.model import DSparkModel
from backends.dspark.profile import load_or_profile, measure_round
from backends.dspark.selection import SpanPolicy
from backends.dspark.traffic import TrafficCaches
from backends.engine import BatchLimits
from backends.errors import InvalidRequestError, ModelLoadError
from backends.loading import LoadedModel, load_shared
from backends.local import LocalBackend
from backends.scheduling import DraftCost, Lookup, VerifySchedule
from backends.steps import DecodeLoop
from backends.threads import on_own_thread
from backends.traffic_settings import TrafficSettings
from backends.types import DSparkOptions, GenerationRequest, GenerationStats

Drafter = Literal["heads", "dspark"]
DEFAULT_DRAFTER: Drafter = "dspark"
DEFAULT_LOOKUP: Lookup = "beside"
"""The decoding a pool uses when its config names none and the model folder carries that drafter: the hybrid,
the drafter's block or a copied one chosen per round by their measured acceptance. It became the default once the
drafter's pass was compiled (backbone, then the greedy Markov stage): a pass then cost 0.27 of a plain step on a
Zen 4 and 0.18 on an Intel Xeon, and ``bench decode`` put the hybrid first on 9 of 12 sets on the Zen 4 and on 8
of 12 on the Xeon (the README has the runs). Before, when a pass cost about a step, blocks copied from the context alone
(``only``) were the default, fastest on 9-11 of 12 sets on four CPUs. The published drafter stays loaded either
way, so a pool's ``decoding.lookup`` or a request's ``dspark.lookup`` (``only``: copies alone; ``off``: the drafter
alone) picks another without naming a drafter; the hybrid was faster than the span heads on all 12 sets on every
CPU measured."""


class DSparkBackend(LocalBackend):
    name = "dspark"

    def __init__(
        self,
        model: DSparkModel | None,
        policy: SpanPolicy | None = None,
        *,
        drafter: DSparkDrafter | None = None,
        schedule: VerifySchedule | None = None,
        default: Drafter = "heads",
        loaded: LoadedModel | None = None,
        limits: BatchLimits | None = None,
        draft_cost: DraftCost | None = None,
        copies: CopyAcceptance | None = None,
        traffic: TrafficCaches | None = None,
        traffic_acceptance: CopyAcceptance | None = None,
        datastore: Datastore | None = None,
        datastore_acceptance: CopyAcceptance | None = None,
    ) -> None:
        if (model if default == "heads" else drafter) is None:
            raise ModelLoadError(f"a DSpark backend with drafter {default!r} needs that drafter", param="model")
        layers = () if drafter is None else state_layers(drafter.config.target_layer_ids)
        super().__init__(model.loaded if model is not None else loaded, limits, layers)
        self.model = model
        self.drafter = drafter
        self.schedule = schedule or VerifySchedule()
        self.draft_cost = draft_cost or DraftCost(self.schedule.draft_s)
        """The published drafter's pass as measured in this pool's loops, shared by every request."""
        self.copies = copies or CopyAcceptance()
        """What this pool's copied blocks earned by the length of their match, shared by every request."""
        self.traffic = traffic or TrafficCaches(TrafficSettings())
        """This pool's earlier answers, one cache per scope (:mod:`backends.dspark.traffic`)."""
        self.traffic_acceptance = traffic_acceptance or CopyAcceptance()
        """What this pool's traffic drafts earned by the length of their match, shared by every request."""
        self.datastore = datastore
        """The target's own answers shipped with its drafters (:mod:`backends.dspark.datastore`), where the pool
        reads them."""
        self.datastore_acceptance = datastore_acceptance or CopyAcceptance()
        """What drafts from the datastore earned in this pool by the length of their match."""
        self.default: Drafter = default
        self.policy = policy
        if model is not None and policy is None:
            config = model.dspark_config
            self.policy = SpanPolicy(tuple(config.span_lengths), dict(config.thresholds))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        span_lengths: tuple[int, ...] | None = None,
        thresholds: dict[int, float] | None = None,
        verification: str = "exact",
        drafter: Drafter | None = None,
        drafter_path: str | Path | None = None,
        limits: BatchLimits | None = None,
        threads: int | None = None,
        traffic: TrafficSettings | None = None,
    ) -> DSparkBackend:
        """Span-heads options default to what their dspark_config.json was tuned with. Both drafters come from
        ``drafter_path`` when given, else from :func:`~backends.default_model.drafters_for` the model (its own
        folder, or the default model's drafters): span heads there, the published drafter in
        its ``dspark_drafter/`` (or ``drafter_path`` is itself a published drafter folder, as a released checkpoint
        like ``deepseek-ai/dspark_qwen3_8b_block7`` is). The SPS profile is kept in the same folder (measured on
        first load on a machine). The pool's ``drafter`` must be there; the other is optional. No ``drafter``:
        :data:`DEFAULT_DRAFTER` where the folder carries it, else the one it does carry.

        Loading runs torch work big enough for OpenMP (the SPS profile, the drafter's round costs): it runs on a
        thread that ends with it, whoever calls, so that no OpenMP team outlives it in the caller's thread and
        slows transformers' engine where it serves (:mod:`backends.threads`; the packed engine's own threads are out
        of its reach)."""
        folder = Path(path)
        drafters = Path(drafter_path) if drafter_path is not None else drafters_for(folder)
        if drafter_path is not None and not drafters.is_dir():
            raise ModelLoadError(f"drafter path {str(drafters)!r} does not exist", param="drafter_path")
        published_dir = drafters if is_drafter_dir(drafters) else drafters / DRAFTER_DIR
        carried = {"heads": (drafters / HEADS_CONFIG_FILE).is_file(), "dspark": is_drafter_dir(published_dir)}
        default = drafter or next((d for d in (DEFAULT_DRAFTER, *carried) if carried[d]), None)

        def load() -> DSparkBackend:
            loaded = load_shared(folder, device=device, dtype=dtype, threads=threads)
            if default is None:
                raise ModelLoadError(
                    f"{str(drafters)!r} holds no DSpark drafter: neither span heads ({HEADS_CONFIG_FILE}) nor a "
                    f"published drafter ({DRAFTER_DIR}/); train them with `dspark-router train all` or use the "
                    "autoregressive backend",
                    param="model",
                )
            model = None
            if default == "heads" or carried["heads"]:
                model = DSparkModel(loaded, SpanHeads.load(drafters, loaded.model.get_output_embeddings()))
            published, schedule = None, None
            if default == "dspark" or carried["dspark"]:
                published = load_drafter(loaded, published_dir)
            if loaded.packed is not None:
                for serving in (model.heads if model else None, published):
                    if serving is not None:
                        serving.serve_from(loaded.packed)
            if published is not None:
                rows = (limits or BatchLimits()).max_batch
                sps = load_or_profile(drafters, loaded, rows * (published.block_size + 1))
                draft_s = measure_round(loaded, published).draft_s
                schedule = VerifySchedule(sps=sps, verification=verification, draft_s=draft_s, lookup=DEFAULT_LOOKUP)
            policy = None
            if model is not None:
                config = model.dspark_config
                policy = SpanPolicy(
                    span_lengths=tuple(span_lengths or config.span_lengths),
                    thresholds=dict(thresholds or config.thresholds),
                    verification=verification,
                )
            settings = traffic or TrafficSettings()
            return cls(
                model,
                policy,
                drafter=published,
                schedule=schedule,
                default=default,
                loaded=loaded,
                limits=limits,
                traffic=TrafficCaches(settings),
                datastore=Datastore.open(drafters / CORPUS_DIR) if settings.datastore else None,
            )

        return on_own_thread(load)

    @property
    def draft_s(self) -> float:
        """Seconds of drafting a round costs outside the target's forward: the published drafter's pass; span
        heads draft inside the forward and copied blocks alone are looked up, so nothing."""
        return self.draft_cost.seconds if self.default == "dspark" and self.schedule.lookup != "only" else 0.0

    def cache_bytes(self) -> dict[str, int]:
        stored = {"datastore": self.datastore.memory_bytes} if self.datastore is not None else {}
        return {**super().cache_bytes(), "traffic": self.traffic.memory_bytes, **stored}

    def with_options(self, options: DSparkOptions | None) -> DSparkBackend:
        """This backend with a pool's ``decoding`` options as its defaults (a request may still override them)."""
        if options is None:
            return self
        policy = self.policy
        if self.model is not None:
            policy = SpanPolicy.resolve(self.policy, options, self.model.dspark_config.num_heads)
        return DSparkBackend(
            self.model,
            policy,
            drafter=self.drafter,
            schedule=resolve_schedule(self.schedule, options),
            default=options.drafter or self.default,
            loaded=self.loaded,
            limits=self.engine.limits,
            draft_cost=self.draft_cost,
            copies=self.copies,
            traffic=self.traffic,
            traffic_acceptance=self.traffic_acceptance,
            datastore=self.datastore,
            datastore_acceptance=self.datastore_acceptance,
        )

    def _require(self, drafter: Drafter) -> None:
        if (self.model if drafter == "heads" else self.drafter) is None:
            raise InvalidRequestError(
                f"this DSpark pool's model has no {'span heads' if drafter == 'heads' else 'published drafter'}",
                param="dspark.drafter",
            )

    def _decode(
        self,
        prompt: list[int],
        request: GenerationRequest,
        generator: torch.Generator | None,
        stats: GenerationStats,
        constraint: GrammarConstraint | None,
    ) -> DecodeLoop:
        choice = (request.dspark.drafter if request.dspark is not None else None) or self.default
        self._require(choice)
        if choice == "dspark":
            schedule = resolve_schedule(self.schedule, request.dspark)
            return published_decode.decode(
                self.loaded,
                self.drafter,
                prompt,
                request,
                schedule,
                generator,
                stats,
                constraint,
                self.draft_cost,
                self.copies,
                self._traffic(request),
            )
        policy = SpanPolicy.resolve(self.policy, request.dspark, self.model.dspark_config.num_heads)
        return decode(self.model, prompt, request, policy, generator, stats, constraint)

    def _traffic(self, request: GenerationRequest) -> published_decode.Traffic | None:
        """The request's scope's cache with its options (the pool's, with what the request overrides); None where
        the pool keeps no traffic, and for a sampled request: what it drafts would then depend on what other
        requests wrote before it, and so would the draws its seed gives (and a Redis worker's replay of it, on
        another worker's cache), where greedy output is the same whatever is drafted. Its answer is left out of
        the cache too, which holds what greedy requests wrote."""
        pool = self.traffic.settings
        if not pool.enabled or not request.greedy:
            return None
        asked = request.dspark.traffic if request.dspark is not None else None
        options = pool.model_copy(update=asked.model_dump(exclude_unset=True)) if asked is not None else pool
        return published_decode.Traffic(
            self.traffic,
            request.cache_scope,
            self.traffic_acceptance,
            options,
            self.datastore,
            self.datastore_acceptance,
        )


def resolve_schedule(schedule: VerifySchedule, options: DSparkOptions | None) -> VerifySchedule:
    """``schedule`` with a pool's or request's overrides: ``max_span`` caps anchor plus draft, as for the heads."""
    if options is None:
        return schedule
    return VerifySchedule(
        sps=schedule.sps,
        draft_s=schedule.draft_s,
        threshold=options.confidence_threshold if options.confidence_threshold is not None else schedule.threshold,
        max_draft=options.max_span - 1 if options.max_span is not None else schedule.max_draft,
        verification=options.verification or schedule.verification,
        lookup=options.lookup or schedule.lookup,
        trees=options.trees if options.trees is not None else schedule.trees,
    )


def load_drafter(loaded: LoadedModel, path: Path) -> DSparkDrafter:
    """The published drafter at ``path`` on ``loaded``'s embedding and LM head; one built for a target of another
    depth is refused, since its target_layer_ids would pick the wrong features."""
    drafter = DSparkDrafter.load(path, loaded.model.get_input_embeddings(), loaded.model.get_output_embeddings())
    layers = loaded.model.config.get_text_config().num_hidden_layers
    if drafter.config.num_target_layers != layers:
        raise ModelLoadError(
            f"drafter {str(path)!r} is for a {drafter.config.num_target_layers}-layer target, this one has {layers}",
            param="drafter",
        )
    return drafter
