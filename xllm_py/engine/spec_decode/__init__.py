"""Speculative decoding without a draft model: a proposer guesses the next tokens of a
sequence from its own tokens (ngram.py, suffix.py) or its request's prediction
(prediction.py), the scheduler runs its last token plus the guesses in one step, and the
longest prefix the model agrees with is kept (verify.py: the argmax, or for sampled rows
speculative sampling); the Speculator (speculator.py) decides who proposes and rolls the
KV back."""
