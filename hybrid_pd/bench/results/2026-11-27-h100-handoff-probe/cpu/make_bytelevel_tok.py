"""A synthetic 131k-vocab byte-level BPE tokenizer (GPT-2/Nemotron style decoder) to time decoding at a real vocab size."""
import random
from tokenizers import Tokenizer, models, decoders, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
alphabet = ByteLevel.alphabet()
rng = random.Random(0)
vocab = {c: i for i, c in enumerate(sorted(alphabet))}
letters = "abcdefghijklmnopqrstuvwxyzĠ"
while len(vocab) < 131072:
    t = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
    vocab.setdefault(t, len(vocab))
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.save("/tmp/handoff-probe/bytelevel-131k.json")
print(len(vocab))
