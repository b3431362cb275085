"""Speculative decoding on the decode side: proposers guess a sequence's next tokens, the target model
verifies them all in one forward pass, and an adaptive controller decides how many to guess.

    proposer.py   the interface a proposer implements (a draft model can plug in later)
    ngram.py      prompt lookup: the tokens that followed the last earlier occurrence of the suffix
    suffix.py     suffix decoding: a frequency trie over the request's tokens and recent outputs
    verify.py     acceptance: longest matching prefix (greedy), rejection sampling (sampled)
    controller.py how many drafts pay off, from measured step costs and each sequence's acceptance
    speculator.py the engine's side: drafts before a step, feedback and counters after it
"""

# No re-exports: the router's process reads SpecStats (speculator.py) without loading torch (verify.py).
