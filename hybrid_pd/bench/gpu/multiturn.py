"""Multi-turn chat on the goodput runner's servers: hybrid-pd against colocated replicas, both with prefix caching on.

The servers and routers are :mod:`hybrid_pd.bench.gpu.goodput`'s (same systems, same start, same
flags: everything after this runner's own flags goes to it), started with prefix caching on and
the routers' policies as given; the conversations are :mod:`hybrid_pd.bench.multiturn`'s. Each
system runs every level (conversations at once) on the same conversations; ``--salted`` systems
run them once more with a cache salt per request, which hits nothing on the same engines (the
caching-off reference for TTFT). ``--check N`` first sends N conversations through each system
and every turn again to one colocated server with a fresh salt: the answers with prefix hits
must equal those without (bf16: up to a near-tie, as the GSM8K gate counts them)::

    python3 -m hybrid_pd.bench.gpu.multiturn --conversations 32 --turns 4 --system-tokens 1500 \\
        --user-tokens 100-300 --output-tokens 100 --levels 8,32 --salted pd --check 4 -- \\
        --out DIR --model /tmp/full/nemotron_h --systems replicas,pd \\
        --server-arg=--vllm-arg=--enable-prefix-caching \\
        --router-arg=--decode-policy=prefix_reuse --router-arg=--prefill-policy=prefix_reuse

Writes ``DIR/multiturn/<system>-c<level>[-salted].json`` and ``DIR/multiturn/summary.json`` and
prints a line per run. Stop the servers with ``python3 -m hybrid_pd.bench.gpu.goodput down --out DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import uuid
from dataclasses import replace

from transformers import AutoTokenizer

from hybrid_pd.bench.gpu import goodput
from hybrid_pd.bench.gpu.gsm8k_gate import NEAR_TIE
from hybrid_pd.bench.gpu.pd_check import compare, completion
from hybrid_pd.bench.multiturn import Conversations, measure, table
from hybrid_pd.worker.supervise import logged_attention_block

__all__ = ["equal_turns", "main", "worker_groups"]

# The router flag a server sits behind -> the group its cache counters are read in.
_GROUPS = {"--prefill": "prefill", "--decode": "decode", "--flex": "flex"}


def worker_groups(system: goodput.System, urls: dict[str, str]) -> dict[str, list[str]]:
    """The URLs of a system's servers by the role the router gives them."""
    groups: dict[str, list[str]] = {}
    for flag, server in system.legs:
        groups.setdefault(_GROUPS[flag], []).append(urls[server])
    return groups


def equal_turns(router: str, reference: str, spec: Conversations, conversations: int, max_tokens: int = 16) -> list[dict]:
    """Conversations through ``router`` (prefix hits) and each turn again on ``reference`` with a fresh cache salt (no hit).

    Greedy with top-2 logprobs; the next turn extends the router's answer. A row per turn:
    where the answers part and the reference's top-2 gap there (bf16 ties part within NEAR_TIE).
    """
    rows = []
    for index in range(conversations):
        rng = random.Random(f"check-{index}")
        prompt = spec.ids(rng, spec.system_tokens)
        for turn in range(spec.turns):
            prompt = prompt + spec.ids(rng, rng.randint(*spec.user_tokens))
            pd = completion(router, goodput.NAME, prompt, max_tokens)
            alone = completion(reference, goodput.NAME, prompt, max_tokens, cache_salt=uuid.uuid4().hex)
            row = {"conversation": index, "turn": turn, "prompt_tokens": len(prompt), **compare(pd, alone)}
            row["equal"] = row["first_divergence"] is None or (row["top2_gap_at_divergence"] or 0.0) <= NEAR_TIE
            rows.append(row)
            prompt = prompt + pd["token_ids"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--user-tokens", default="100-300")
    ap.add_argument("--output-tokens", type=int, default=100)
    ap.add_argument("--shared-system", action="store_true")
    ap.add_argument("--levels", default="8,32", type=lambda s: [int(x) for x in s.split(",")], help="conversations at once")
    ap.add_argument("--check", type=int, default=0, metavar="N", help="first: N conversations through each system against colocated0 with no hit")
    ap.add_argument("--salted", default="", type=lambda s: [x for x in s.split(",") if x], help="systems also run with a cache salt per request")
    own, rest = ap.parse_known_args(argv)
    args = goodput.parse_args(["run", *[a for a in rest if a != "--"]])
    args.out.mkdir(parents=True, exist_ok=True)
    state = goodput.up(args)
    systems = args.systems
    low, _, high = own.user_tokens.partition("-")
    vocab = len(AutoTokenizer.from_pretrained(str(args.model)))  # built checkpoints carry our 512-token tokenizer
    spec = Conversations(own.conversations, own.turns, own.system_tokens, (int(low), int(high or low)), own.output_tokens, own.shared_system, vocab)
    # Where prefix hits land: the attention block the servers' engines logged (their metrics show an earlier one on vLLM 0.26).
    granule = logged_attention_block("".join(p.read_text(errors="replace") for p in sorted((args.out / "logs").glob("*.log"))))
    out = args.out / "multiturn"
    out.mkdir(exist_ok=True)
    rows = []
    checks = {}
    with contextlib.ExitStack() as stack:  # a router per system over the runner's servers, for the whole run
        urls = {name: stack.enter_context(goodput.router(name, state["urls"], args.slo[0], args, args.out / "logs" / f"router-{name}-multiturn.log"))
                for name in systems}  # fmt: skip
        for system in systems:  # the first conversations after start compile and capture: not measured
            measure(urls[system], goodput.NAME, replace(spec, conversations=2, seed=99), 2, {}, args.slo, args.gpus)
        for system in systems if own.check else ():
            checks[system] = equal_turns(urls[system], state["urls"]["colocated0"], spec, own.check)
            parted = [r for r in checks[system] if not r["equal"]]
            print(f"{system}: {len(checks[system]) - len(parted)}/{len(checks[system])} turns equal to colocated0 without hits {parted}", flush=True)
        for level in own.levels:
            for system in systems:
                groups = worker_groups(goodput.system(system, args.gpus), state["urls"])
                for salted in (False, True) if system in own.salted else (False,):
                    # Fresh tokens per system and level, same lengths: pd and adaptive share servers, and every level would
                    # otherwise find the last one's conversations cached (measured: 158% of the ideal).
                    fresh = replace(spec, tag=f"{system}-c{level}")
                    result = measure(urls[system], goodput.NAME, fresh, level, groups, args.slo, args.gpus, salt=salted, granule=granule)
                    row = {"system": system, "level": level, "salted": salted, **result}
                    name = f"{system}-c{level}{'-salted' if salted else ''}"
                    (out / f"{name}.json").write_text(json.dumps(row, indent=1))
                    print(f"{name}: {table(result['summary'])}{' errors: ' + repr(result['errors']) if result['errors'] else ''}", flush=True)
                    rows.append(row)
    (out / "summary.json").write_text(json.dumps({"versions": goodput.versions(), "rows": rows, "checks": checks}, indent=1))
    failed = any(r["summary"]["failed"] for r in rows) or any(not r["equal"] for turns in checks.values() for r in turns)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
