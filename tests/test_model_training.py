"""The embedded default model and the script that trains it: data format, a smoke run, the shipped files.

No vLLM here: the shipped directory is loaded with transformers, and training runs a
few steps of a very small configuration.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybrid_pd import default_model  # noqa: E402
from hybrid_pd.eval import synthetic  # noqa: E402
from hybrid_pd.eval.prompts import build_prompt, fewshot_prefix  # noqa: E402
from hybrid_pd.models import train as training  # noqa: E402

# A very small hybrid of the same kind: mamba, attention, mlp; heads and groups even.
SMOKE_CONFIG = dict(
    training.MODEL_CONFIG,
    hidden_size=32,
    layers_block_type=["mamba", "attention", "mlp"],
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    mamba_num_heads=2,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=8,
)
SMOKE_RECIPE = dataclasses.replace(
    training.RECIPE, steps=20, batch_size=2, seq_len=256, warmup_steps=2, tokenizer_problems=200
)


@pytest.fixture(scope="module")
def shipped_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_model.ensure_default_model())


def test_training_rows_continue_the_eval_prompt(shipped_tokenizer) -> None:
    """The eval's k-shot prompt (k = 0, 2) starts a training row, as text and as tokens; the answer follows."""
    problems = synthetic.generate(3, seed=0, split="test")
    for k in (0, 2):
        prompt = build_prompt(fewshot_prefix(problems[:k]), problems[k])
        row = training.row_text(problems[: k + 1])
        assert row == prompt + " " + problems[k].answer
        prompt_ids = shipped_tokenizer(prompt)["input_ids"]
        row_ids = shipped_tokenizer(row)["input_ids"]
        assert row_ids[: len(prompt_ids)] == prompt_ids
        assert shipped_tokenizer.decode(row_ids[len(prompt_ids) :]) == " " + problems[k].answer
    # Inside a row, every answer is followed by the eval's stop sequence.
    assert problems[0].answer + "\n\nQuestion: " in training.row_text(problems)


def test_pack_rows_trains_on_answers_not_question_bodies(shipped_tokenizer) -> None:
    problems = synthetic.generate(40, seed=0, split="train")
    ids, labels = training.pack_rows(problems, shipped_tokenizer, seq_len=256, rows=4)
    assert ids.shape == labels.shape == (4, 256)
    packed = 0
    for row in range(4):
        real = ids[row] != shipped_tokenizer.pad_token_id
        assert (labels[row][~real] == -100).all()
        text = shipped_tokenizer.decode(ids[row][real])
        learned = shipped_tokenizer.decode(labels[row][labels[row] != -100])
        count = text.count("Question: ")
        assert count >= 2 and text == training.row_text(problems[packed : packed + count])
        for problem in problems[packed : packed + count]:
            assert problem.answer in learned and problem.question not in learned
        packed += count


def test_smoke_training_lowers_the_loss_and_saves_a_loadable_model(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    summary = training.train(tmp_path, SMOKE_RECIPE, SMOKE_CONFIG, log=lambda line: None)
    assert summary["recipe"]["steps"] == 20 and summary["parameters"] > 0
    assert json.loads((tmp_path / "training.json").read_text())["parameters"] == summary["parameters"]

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    problems = synthetic.generate(SMOKE_RECIPE.steps * SMOKE_RECIPE.batch_size * 4, seed=SMOKE_RECIPE.seed)
    ids, labels = training.pack_rows(problems, tokenizer, SMOKE_RECIPE.seq_len, rows=4)
    initial = training.build_model(SMOKE_CONFIG, SMOKE_RECIPE.seed).eval()
    with torch.no_grad():
        before = initial(input_ids=ids, labels=labels, use_cache=False).loss.item()
        after = model(input_ids=ids, labels=labels, use_cache=False).loss.item()
    assert after < before - 0.5, (before, after)


def test_shipped_model_is_a_nemotron_h_hybrid() -> None:
    path = default_model.ensure_default_model()
    assert default_model.resolve_model(None) == (str(path), "hybrid-pd-tiny")
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.model_type == "nemotron_h" and config.architectures == ["NemotronHForCausalLM"]
    assert {"linear_attention", "full_attention", "mlp"} <= set(config.layers_block_type)  # mamba, attention, mlp
    # Tensor parallel 2 splits every head and group.
    for heads in (config.num_attention_heads, config.num_key_value_heads, config.mamba_num_heads, config.n_groups):
        assert heads % 2 == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    # The end-to-end tests send token ids up to 489: every id below vocab_size is a real token.
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config.vocab_size == training.VOCAB_SIZE
    recorded = json.loads((path / "training.json").read_text())
    assert recorded["recipe"] == json.loads(json.dumps(dataclasses.asdict(training.RECIPE)))


def test_tokenizer_round_trips_digits_and_has_the_chat_template(shipped_tokenizer) -> None:
    text = "Question: Ava has 1234567890 apples.\nAnswer: 48 + 25 = <<48+25=73>>73\n#### 73"
    ids = shipped_tokenizer(text)["input_ids"]
    assert shipped_tokenizer.decode(ids) == text
    digits = shipped_tokenizer("1234567890")["input_ids"]
    assert [shipped_tokenizer.decode([i]) for i in digits] == list("1234567890")
    chat = shipped_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert shipped_tokenizer.eos_token == "<|eos|>" and shipped_tokenizer.pad_token == "<|pad|>"


@pytest.mark.parametrize("shots", [0, 5])
def test_shipped_model_solves_held_out_problems(shipped_tokenizer, shots: int) -> None:
    """Greedy, scored like the eval, zero-shot and with the eval's default 5 shots: the first test problems."""
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model.ensure_default_model())
    problems = synthetic.generate(4, seed=0, split="test")
    assert training.check_accuracy(model, shipped_tokenizer, problems, shots=shots) == 1.0
