"""Asking a language model for a decision, as the agents that run a federation do (the aggregator's
selector, the client's guardian): the question and its answer (asking), and JSON answers that must
parse, decoded under a grammar and a deadline (constrained)."""
