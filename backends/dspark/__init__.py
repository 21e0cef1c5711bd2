"""DSpark: a drafter on a causal LM, confidence-scheduled proposals, verification in the target's pass.

Two drafters: span heads (``heads``) and the published DSpark drafter (``dspark``: parallel backbone over the
target's features, Markov and confidence heads, Algorithm 1 scheduling, DeepSpec's checkpoint layout). Both
loops verify through :mod:`backends.dspark.verify`; the verification schedule they share with the batching
engine lives below them, in :mod:`backends.scheduling`. Each name is imported from its own module
(``backends.dspark.backend.DSparkBackend``), so ``python -m backends.dspark.profile`` runs without loading the
backend first.
"""
