"""Multi-turn chat as users send it: each turn is the conversation so far plus a new user message.

``vllm bench serve`` sends independent prompts (its ``prefix_repetition`` dataset shares a prefix
but has no turns), so this driver keeps conversations: every turn's prompt is the last turn's
prompt, the answer it got (the token ids vLLM streamed back, ``return_token_ids``) and a new user
message, after a system prompt (one for all conversations with ``--shared-system``, else one per
conversation). ``--concurrency`` conversations run at once, each turn after the last one's answer.

It reports what the prefix cache did, read from the workers' own counters
(``vllm:prefix_cache_hits`` / ``queries``, before and after): hit tokens, prompt tokens computed,
and the hits against the *reusable ideal*, every prompt's longest prefix shared with an earlier
prompt, rounded down to the granule where the workers' hits land (a hybrid's state checkpoint
block, :func:`hybrid_pd.common.prom.prefix_hit_tokens`). Latency as vLLM's client measures it:
TTFT of first turns and of later turns apart, TPOT, throughput and goodput per GPU for each SLO.
``--cache-salt`` gives every request a salt of its own: the same servers with no hit at all,
the "caching off" reference on the very same engines.

    python -m hybrid_pd.bench.multiturn --url http://127.0.0.1:8000 --model NAME \\
        --conversations 32 --turns 4 --system-tokens 1500 --user-tokens 100-300 --output-tokens 100 \\
        --concurrency 16 --metrics prefill=http://P --metrics decode=http://D --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from hybrid_pd.bench.client import RequestResult, Sampling, complete
from hybrid_pd.bench.stats import percentile
from hybrid_pd.common.prom import metric_sum, prefix_hit_tokens

__all__ = ["Conversations", "Turn", "ideal_reusable", "main", "request_id", "run", "summarize"]

HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


@dataclass(frozen=True)
class Conversations:
    """The workload: how many conversations, how long, drawn from ``seed``."""

    conversations: int = 8
    turns: int = 4
    system_tokens: int = 1500
    user_tokens: tuple[int, int] = (100, 300)
    output_tokens: int = 100
    shared_system: bool = False
    vocab: int = 32000
    seed: int = 0
    # The tokens' own seed: runs with other tags send conversations of the very same lengths with
    # other tokens, so a run on servers an earlier run used finds nothing of it in their caches.
    tag: str = ""

    def ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(10, self.vocab - 10) for _ in range(n)]


@dataclass(frozen=True)
class Turn:
    """One request of a conversation, as it went."""

    conversation: int
    turn: int
    prompt: tuple[int, ...]
    result: RequestResult


def request_id(spec: Conversations, index: int, turn: int, salt: bool) -> str:
    """A turn's ``X-Request-Id``: unique per run (tag, salted or not), and ending in ``-<conversation>`` so that a hand-off
    timeline groups a run's requests by turn (``python -m hybrid_pd.bench.budget``: one budget per ``<tag>-turn<t>``)."""
    return f"{spec.tag or 'conv'}{'-salted' if salt else ''}-turn{turn}-{index}"


async def _conversation(
    client: httpx.AsyncClient, url: str, sampling: Sampling, spec: Conversations, index: int, system: list[int], salt: bool
) -> list[Turn]:
    lengths, rng = random.Random(f"{spec.seed}-{index}"), random.Random(f"{spec.seed}-{index}-{spec.tag}")
    history = list(system)
    turns = []
    for turn in range(spec.turns):
        prompt = history + spec.ids(rng, lengths.randint(*spec.user_tokens))
        body = {**sampling.body(prompt), "return_token_ids": True}
        rid = request_id(spec, index, turn, salt)
        if salt:  # the request's own id: no other request of this run or of another hits what it cached
            body["cache_salt"] = rid
        result = await complete(client, url + "/v1/completions", body, request_id=rid)
        turns.append(Turn(index, turn, tuple(prompt), result))
        if not result.ok:
            break
        # The answer as the model gave it; a server that streams no token ids gets stand-ins of the same length.
        history = prompt + list(result.output_ids or spec.ids(rng, result.output_tokens))
    return turns


async def run(url: str, model: str, spec: Conversations, concurrency: int, salt: bool = False) -> list[Turn]:
    """Every conversation of ``spec`` through ``url``, ``concurrency`` at a time; its turns in the order they were sent."""
    sampling = Sampling(model, spec.output_tokens)
    shared = spec.ids(random.Random(f"{spec.seed}-{spec.tag}"), spec.system_tokens)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def one(index: int, client: httpx.AsyncClient) -> list[Turn]:
        system = shared if spec.shared_system else spec.ids(random.Random(f"{spec.seed}-system-{index}-{spec.tag}"), spec.system_tokens)
        async with gate:
            return await _conversation(client, url, sampling, spec, index, system, salt)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        done = await asyncio.gather(*(one(i, client) for i in range(spec.conversations)))
    return sorted((t for turns in done for t in turns), key=lambda t: t.result.sent_at)


def ideal_reusable(turns: Sequence[Turn], granule: int | None) -> int:
    """Tokens a prefix cache could have resumed: each prompt's longest prefix shared with a prompt sent before it, rounded down to ``granule``.

    Short of the whole prompt (vLLM computes its last token) and 0 without a granule (prefix caching off).
    """
    if not granule:
        return 0
    total, earlier = 0, []
    for t in turns:
        shared = max((_common(t.prompt, p) for p in earlier), default=0)
        total += min(shared, len(t.prompt) - 1) // granule * granule
        earlier.append(t.prompt)
    return total


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def cache_counters(urls: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """Prefix-cache hit and query tokens so far, per group of workers (e.g. prefill, decode)."""
    counts = {}
    for group, members in urls.items():
        texts = [httpx.get(u + "/metrics", timeout=10).text for u in members]
        counts[group] = {"hits": sum(metric_sum(t, HITS) for t in texts), "queries": sum(metric_sum(t, QUERIES) for t in texts)}
    return counts


def granule_of(urls: dict[str, list[str]]) -> int | None:
    """Where the workers' prefix-cache hits land (the first worker's; the router pairs only alike workers)."""
    first = next((u for members in urls.values() for u in members), None)
    return None if first is None else prefix_hit_tokens(httpx.get(first + "/metrics", timeout=10).text)


def summarize(
    turns: Sequence[Turn], wall_s: float, slos: Sequence[tuple[float, float]], gpus: int, cache: dict[str, dict[str, float]], ideal: int
) -> dict[str, Any]:
    """TTFT of first and later turns, TPOT, throughput, goodput per GPU per SLO and the cache's figures."""
    ok = [t for t in turns if t.result.ok]

    def ms(values: list[float]) -> dict[str, float | None]:
        return {"p50": percentile(values, 50) * 1e3 if values else None, "p99": percentile(values, 99) * 1e3 if values else None}

    tpots = [t.result.tpot_s for t in ok if t.result.tpot_s is not None]
    goodput = {}
    for ttft_ms, tpot_ms in slos:
        met = sum(1 for t in ok if t.result.ttft_s * 1e3 <= ttft_ms and (t.result.tpot_s or 0.0) * 1e3 <= tpot_ms)
        goodput[f"{ttft_ms:g}/{tpot_ms:g}"] = {"req_s": met / wall_s, "req_s_per_gpu": met / wall_s / gpus}
    prompt_tokens = sum(len(t.prompt) for t in ok)
    return {
        "requests": len(turns),
        "failed": len(turns) - len(ok),
        "wall_s": wall_s,
        "throughput_req_s": len(ok) / wall_s,
        "output_tok_s": sum(t.result.output_tokens for t in ok) / wall_s,
        "ttft_first_turn_ms": ms([t.result.ttft_s for t in ok if t.turn == 0]),
        "ttft_later_turns_ms": ms([t.result.ttft_s for t in ok if t.turn > 0]),
        "tpot_mean_ms": sum(tpots) / len(tpots) * 1e3 if tpots else None,
        "goodput": goodput,
        "prompt_tokens": prompt_tokens,
        "reusable_ideal_tokens": ideal,
        "cache": {
            group: {**c, "computed": c["queries"] - c["hits"], "hit_share_of_ideal": c["hits"] / ideal if ideal else None}
            for group, c in cache.items()
        },
    }


def table(summary: dict[str, Any]) -> str:
    """One line a human reads."""
    cache = "; ".join(f"{g} hits {c['hits']:.0f}/{c['queries']:.0f} tok ({(c['hit_share_of_ideal'] or 0) * 100:.0f}% of ideal)" for g, c in summary["cache"].items())
    good = ", ".join(f"{k} {v['req_s_per_gpu']:.2f}/GPU" for k, v in summary["goodput"].items())
    return (
        f"{summary['requests']} requests ({summary['failed']} failed) in {summary['wall_s']:.1f} s: {summary['throughput_req_s']:.2f} req/s; "
        f"TTFT p50 first turns {summary['ttft_first_turn_ms']['p50'] or 0:.1f} ms, later {summary['ttft_later_turns_ms']['p50'] or 0:.1f} ms; "
        f"TPOT {summary['tpot_mean_ms'] or 0:.2f} ms; goodput {good}; ideal {summary['reusable_ideal_tokens']} tok; {cache}"
    )


def measure(url: str, model: str, spec: Conversations, concurrency: int, metrics: dict[str, list[str]], slos: Sequence[tuple[float, float]],
            gpus: int, salt: bool = False, granule: int | None = None) -> dict[str, Any]:  # fmt: skip
    """One run, with the workers' cache counters read before and after; the summary and the workload.

    ``granule``: where the workers' hits land, when their metrics do not say (vLLM 0.26 shows the
    block size from before the engine raised it: :func:`hybrid_pd.common.prom.prefix_hit_tokens`).
    """
    before = cache_counters(metrics)
    started = time.perf_counter()
    turns = asyncio.run(run(url, model, spec, concurrency, salt))
    wall = time.perf_counter() - started
    after = cache_counters(metrics)
    cache = {g: {k: after[g][k] - before[g][k] for k in after[g]} for g in after}
    ideal = 0 if salt else ideal_reusable(turns, granule or granule_of(metrics))
    summary = summarize(turns, wall, slos, gpus, cache, ideal)
    errors = sorted({t.result.error for t in turns if t.result.error})
    return {"workload": {**asdict(spec), "concurrency": concurrency, "cache_salt": salt}, "summary": summary, "errors": errors[:5]}


def _metrics(text: str) -> tuple[str, str]:
    group, _, url = text.partition("=")
    return group, url.rstrip("/")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the router (or a server) to send to")
    ap.add_argument("--model", required=True)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--user-tokens", default="100-300", help="LOW-HIGH tokens of each user message")
    ap.add_argument("--output-tokens", type=int, default=100)
    ap.add_argument("--shared-system", action="store_true", help="one system prompt for every conversation")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="the tokens' own seed and the request ids' prefix: runs with other tags send other tokens")
    ap.add_argument("--concurrency", type=int, default=8, help="conversations at once")
    ap.add_argument("--cache-salt", action="store_true", help="a salt per request: no prefix hit anywhere")
    ap.add_argument("--metrics", action="append", type=_metrics, default=[], help="GROUP=URL of a worker whose prefix-cache counters to read (repeatable)")
    ap.add_argument("--slo", action="append", help="TTFT/TPOT ms (repeatable; default 500/20 and 1500/50)")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs behind --url, for goodput per GPU")
    ap.add_argument("--granule", type=int, help="tokens where prefix hits land (default: the first --metrics worker's cache_config_info)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    low, _, high = args.user_tokens.partition("-")
    spec = Conversations(args.conversations, args.turns, args.system_tokens, (int(low), int(high or low)), args.output_tokens,
                         args.shared_system, args.vocab, args.seed, args.tag)  # fmt: skip
    slos = [tuple(float(x) for x in s.split("/")) for s in args.slo or ["500/20", "1500/50"]]
    groups: dict[str, list[str]] = {}
    for group, url in args.metrics:
        groups.setdefault(group, []).append(url)
    result = measure(args.url.rstrip("/"), args.model, spec, args.concurrency, groups, slos, args.gpus, args.cache_salt, args.granule)
    print(table(result["summary"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["summary"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
