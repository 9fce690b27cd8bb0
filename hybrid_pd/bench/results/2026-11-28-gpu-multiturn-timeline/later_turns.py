"""The hand-off budget of later turns (turns 2-4), p50 per segment, of the runs' 1P1D pairs with a timeline: a markdown table.

    python3 later_turns.py   # reads run1/ and run2-prefill-sync/per-request.json.gz
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = [("run1", "ded-c1", "1 at once, async"), ("run1", "ded-c8", "8, async (run 1)"), ("run2-prefill-sync", "ded-c8", "8, async (run 2)"),
           ("run2-prefill-sync", "sync-c8", "8, sync (run 2)"), ("run2-prefill-sync", "ded-c16", "16, async"), ("run2-prefill-sync", "sync-c16", "16, sync")]  # fmt: skip
SEGMENTS = [
    ("router_to_prefill_leg", "router: arrival -> prefill leg sent"),
    ("prefill_leg_in", "prefill leg: router -> prefill's server"),
    ("prefill_frontend", "prefill: parsed, rendered (vLLM frontend)"),
    ("prefill_to_engine", "prefill: frontend -> engine core"),
    ("prefill_queue", "prefill: queued -> scheduled"),
    ("prefill_forward", "prefill: scheduled -> done (step, token, state held)"),
    ("handoff_push", "prefill's engine -> push at the decode's server"),
    ("handoff_release", "decode: early leg released"),
    ("decode_to_engine", "decode: engine client -> engine core"),
    ("decode_queue", "decode: queued -> pull allocated"),
    ("pull_post", "decode: pull posted"),
    ("pull_transfer", "decode: transfer, completion noticed"),
    ("decode_row_wait", "decode: pull done -> decode-row step"),
    ("decode_row_out", "decode: decode row, token N out"),
    ("decode_first_byte_in", "decode first byte -> router"),
    ("router_relay", "router: relayed to the client"),
]


def later(folder: str, tag: str) -> list[dict]:
    with gzip.open(HERE / folder / "per-request.json.gz", "rt") as f:
        groups = json.load(f)
    return [r for turn in (1, 2, 3) for r in groups.get(f"{tag}-turn{turn}", [])]


def main() -> None:
    data = {(folder, tag): later(folder, tag) for folder, tag, _ in COLUMNS}
    print("| segment (p50 ms, turns 2-4) | " + " | ".join(label for *_, label in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for name, label in SEGMENTS:
        cells = []
        for folder, tag, _ in COLUMNS:
            values = [r["segments_ms"][name] for r in data[folder, tag] if r["segments_ms"].get(name) is not None]
            cells.append(f"{statistics.median(values):.1f}" if values else "")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| **TTFT p50, router** | " + " | ".join(f"**{statistics.median(r['ttft_ms'] for r in data[f, t]):.1f}**" for f, t, _ in COLUMNS) + " |")
    print("| requests | " + " | ".join(str(len(data[f, t])) for f, t, _ in COLUMNS) + " |")


if __name__ == "__main__":
    main()
