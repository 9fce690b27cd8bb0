"""vLLM 0.32 FastIncrementalDetokenizer: DecodeStream primed with the whole prompt (ids=...) -> first step() cost vs prompt length."""
import random, sys, time, statistics as st
import tokenizers
from tokenizers.decoders import DecodeStream
tok = tokenizers.Tokenizer.from_file(sys.argv[1])
V = tok.get_vocab_size()
print("tokenizers", tokenizers.__version__, "vocab", V, sys.argv[1])
rng = random.Random(0)
def one(N, prime):
    ids = [rng.randrange(3, min(V, 512 if V < 1000 else V)) for _ in range(N)]
    t0 = time.perf_counter()
    s = DecodeStream(ids=ids, skip_special_tokens=True) if prime == "all" else DecodeStream(skip_special_tokens=True)
    if prime == "suffix":  # the pre-"native prefill" vLLM way: step through a <=24-token suffix
        for t in ids[-8:]: s.step(tok, t)
    t1 = time.perf_counter()
    s.step(tok, ids[0]); t2 = time.perf_counter()
    s.step(tok, ids[1]); t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3
for N in (256, 1000, 2000, 4000, 8000):
    for prime in ("all", "suffix"):
        r = [one(N, prime) for _ in range(15)]
        print(f"N={N:5d} prime={prime:6s} construct {st.median(x[0] for x in r):7.3f} ms  first step {st.median(x[1] for x in r):7.3f} ms  second step {st.median(x[2] for x in r):7.3f} ms")
