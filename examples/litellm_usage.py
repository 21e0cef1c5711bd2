"""litellm both ways round.

1. The router as a litellm provider: after ``register(router)``, any litellm call with ``model="dspark-router/auto"``
   runs through the router in this process (``dspark-router/dspark`` and ``dspark-router/standard`` pin a pool).
2. A standard pool served elsewhere: with ``--remote-api-base``, the ``standard`` pool becomes a ``litellm`` pool
   that calls an OpenAI-compatible server (vLLM, a hosted API...) while the DSpark pool stays local.

    python examples/litellm_usage.py
    python examples/litellm_usage.py --remote-api-base http://localhost:8000/v1 --remote-model hosted_vllm/my-model
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from backends.errors import DSparkRouterError
from router import Router
from router.config import PoolConfig, load_config
from router.litellm_backend import import_litellm
from router.litellm_provider import register

MESSAGES = [
    {"role": "system", "content": "You are a coding assistant. Reply with code only."},
    {"role": "user", "content": "Complete the function:\ndef add(a: int, b: int) -> int:\n    "},
]


def build_router(args: argparse.Namespace) -> Router:
    config = load_config(args.config)
    if args.remote_api_base:
        remote = PoolConfig(
            backend="litellm",
            model=args.remote_model,
            api_base=args.remote_api_base,
            api_key=os.environ.get("OPENAI_API_KEY", "none"),
        )
        config = config.model_copy(update={"pools": {**config.pools, "standard": remote}})
    return Router(config)


async def run_async(litellm, max_tokens: int) -> None:
    response = await litellm.acompletion(model="dspark-router/auto", messages=MESSAGES, max_tokens=max_tokens)
    print("acompletion:", repr(response.choices[0].message.content))
    stream = await litellm.acompletion(
        model="dspark-router/auto", messages=MESSAGES, max_tokens=max_tokens, stream=True
    )
    print("astream:    ", repr("".join([chunk.choices[0].delta.content or "" async for chunk in stream])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="router YAML (default: the embedded config on the default model)")
    parser.add_argument("--remote-api-base", help="serve the standard pool from this OpenAI-compatible server")
    parser.add_argument("--remote-model", default="openai/default", help="litellm model name for the remote pool")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    litellm = import_litellm()
    try:
        with build_router(args) as router:
            register(router)
            for model in ("dspark-router/auto", "dspark-router/dspark", "dspark-router/standard"):
                response = litellm.completion(model=model, messages=MESSAGES, max_tokens=args.max_tokens)
                decision = response.choices[0].message.provider_specific_fields["dspark_router"]
                print(f"{model:24} -> pool {decision['pool']:8} ({decision['reason']})")
                print("   ", repr(response.choices[0].message.content))
            chunks = litellm.completion(
                model="dspark-router/dspark", messages=MESSAGES, max_tokens=args.max_tokens, stream=True
            )
            print("stream:     ", repr("".join(chunk.choices[0].delta.content or "" for chunk in chunks)))
            asyncio.run(run_async(litellm, args.max_tokens))
            decisions = router.metrics_text().splitlines()
            print("\n".join(line for line in decisions if line.startswith("dspark_router_decisions_total")))
    except DSparkRouterError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
