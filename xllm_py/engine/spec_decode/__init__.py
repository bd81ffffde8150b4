"""Speculative decoding without a draft model: a proposer guesses the next tokens of a
greedy sequence from its own tokens (ngram.py), the scheduler runs its last token plus
the guesses in one step, and the longest prefix the model agrees with is kept
(verify.py); the Speculator (speculator.py) decides who proposes and rolls the KV back."""
